"""The card's YAML front matter (pure): base model and relation, tags, eval results.

`base_model_relation`: the Hub accepts "adapter", "merge", "quantized" and "finetune"
(https://huggingface.co/docs/hub/model-cards#specifying-a-base-model). An attnkit output is a full
set of weights derived from ONE base model (not a PEFT adapter, not a merge of several models, and
its low-rank factorisation is not a quantisation of the weights' number format), usually healed by
training afterwards, so "finetune" is the relation that fits.
"""

from __future__ import annotations

import math
from typing import Any

from huggingface_hub import EvalResult, ModelCardData

from attnkit.card.names import is_hub_id, source_ref
from attnkit.card.reports import index_metrics, method_of

BASE_MODEL_RELATION = "finetune"


def card_tags(method: str | None, config: dict | None) -> list[str]:
    """attnkit, each step of the method, and the model type config.json names."""
    tags = ["attnkit"]
    if method:
        tags += [part for part in method.split("+") if part]
    model_type = (config or {}).get("model_type")
    if model_type:
        tags.append(str(model_type))
    return list(dict.fromkeys(tags))


def eval_results_for_index(model: dict[str, dict[str, Any]]) -> list[EvalResult]:
    """`model-index` entries: one per numeric (task, metric)."""
    results = []
    for task, metrics in model.items():
        for metric, value in (metrics or {}).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue  # the Hub's model-index takes numbers only
            results.append(
                EvalResult(
                    task_type="text-generation",
                    task_name="Text Generation",
                    dataset_type=task,
                    dataset_name=task,
                    metric_type=metric,
                    metric_name=metric,
                    metric_value=float(value),
                )
            )
    return results


def build_card_data(reports: dict[str, dict | None], model_name: str | None = None) -> ModelCardData:
    """The YAML front matter: base model and relation, tags, library, eval results, and the source
    card's license / datasets / language (only those it has)."""
    convert, finetune, config = reports["convert"], reports["finetune"], reports["config"]
    spec, path = source_ref(convert, finetune)
    base = spec if is_hub_id(spec, path) else None
    results = eval_results_for_index(index_metrics(reports["eval"], finetune))
    return ModelCardData(
        base_model=base,
        base_model_relation=BASE_MODEL_RELATION if base else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=card_tags(method_of(convert), config),
        model_name=model_name if results else None,
        eval_results=results or None,
        **(reports.get("source_card") or {}),
    )
