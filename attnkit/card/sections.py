"""The card's body sections (pure): the conversion, the healing, the evaluation and how to load it.
What a method alone can say comes in as `MethodSections` (hooks.py) and goes where it belongs."""

from __future__ import annotations

from typing import Any

from attnkit.card.hooks import MethodSections, method_title
from attnkit.card.markdown import details, fmt, table, with_stderr
from attnkit.card.names import public_name, scrub
from attnkit.card.reports import eval_limit, finetune_eval_limit, model_metrics, shown
from attnkit.evaluation.ppl import HELD_OUT, VALIDATION, held_out, task_sentence, validation_text
from attnkit.io.resolve import BUNDLED

_COMMON_CONVERT_KEYS = {"attnkit_version", "method", "source", "settings", "kv_cache_bytes_per_token", "steps", "ppl", "load",
                        "params"}


def conversion_section(convert: dict, extra: MethodSections) -> str:
    """## Conversion: what ran on which source, the KV cache and parameters before and after, the
    measured error of each step, the settings, and the report's method-specific keys."""
    method = str(convert.get("method", "?"))
    source = convert.get("source") or {}
    name = public_name(source.get("model"), source.get("path")) or "?"
    bundled = " (attnkit's bundled reference model)" if name in BUNDLED else ""
    parts = [
        "## Conversion",
        "",
        f"Converted by `attnkit convert --to {method}` — {method_title(method)} — from "
        f"`{name}`{bundled} (model type `{source.get('model_type', '?')}`, "
        f"attnkit {convert.get('attnkit_version', '?')}).",
    ]
    for key in ("sha256_config", "sha256_weights_index"):
        if source.get(key):
            parts.append(f"Source `{key}`: `{source[key]}`.")
    kv = convert.get("kv_cache_bytes_per_token") or {}
    if kv.get("before") and kv.get("after"):
        ratio = kv["after"] / kv["before"]
        parts += [
            "",
            f"KV cache per token (all layers, bytes{' in ' + str(kv['dtype']) + ', the dtype it is stored in' if kv.get('dtype') else ''}; "
            "as measured by attnkit):",
            "",
            table(["before", "after", "after / before"], [[kv["before"], kv["after"], f"{ratio:.1%}"]]),
        ]
        for note in extra.kv_notes:
            parts += ["", note]
    parts += _params_part(convert, extra.params)
    ppl = convert.get("ppl") or {}
    if ppl.get("before") is not None and ppl.get("after") is not None:
        calibration = scrub({**({"held_out_from": f"{ppl['split']} split"} if ppl.get("split") else {}),
                             **(convert.get("calibration") or {})})
        parts += ["", f"{held_out(calibration)}: {fmt(ppl['before'])} before → {fmt(ppl['after'])} after conversion "
                      f"(convert's own measure; `attnkit eval`'s attnkit-ppl is another text in other windows)."]
    settings = scrub(convert.get("settings") or {})
    if settings:
        parts += ["", "Settings:", "", table(["setting", "value"], [[k, v] for k, v in sorted(settings.items())])]
    parts += _steps_part(convert.get("steps") or [])
    extras = {k: v for k, v in convert.items() if k not in _COMMON_CONVERT_KEYS}
    if extras:
        parts += ["", details("Method-specific details (attnkit_report.json)", scrub(extras))]
    return "\n".join(parts)


def _steps_part(steps: list) -> list[str]:
    """The measured error of each step of the conversion, with what each step does by itself."""
    if not steps:
        return []
    from attnkit.evaluation.steps import ALONE, step_alone

    cols = ["attn_rel_err_mean", "attn_rel_err_max", "logits_rel_err_mean", "logits_rel_err_max", "kl", "ppl"]
    steps = [s for s in steps if isinstance(s, dict)]
    rows = [[s.get("name", "?"), step_alone(s)] + [s.get(c) for c in cols] for s in steps]
    legend = "; ".join(ALONE.get(k, k) for k in dict.fromkeys(step_alone(s) for s in steps))
    return ["", "Measured error of each step (the columns after *step alone*: the model up to that step, against "
                f"the source; {legend}):", "", table(["step", "step alone"] + cols[:-1] + [HELD_OUT], rows)]


def _params_part(convert: dict, step_params: tuple[dict, str] | None) -> list[str]:
    """Parameters before and after, by part, with why each part changed (`params` of the report; a
    composite's report without its own states the step its method hook names)."""
    params, step = convert.get("params"), ""
    if not isinstance(params, dict) and step_params is not None:
        params, step = step_params
    if not isinstance(params, dict) or not params.get("before") or not params.get("after"):
        return []
    rows = [[part, f"{e.get('before', 0):,}", f"{e.get('after', 0):,}", f"{e.get('after', 0) - e.get('before', 0):+,}",
             e.get("why")] for part, e in (params.get("by_part") or {}).items() if isinstance(e, dict)]
    ratio = params["after"] / params["before"]
    text = (f"Parameters{step}: {params['before']:,} before → {params['after']:,} after (×{ratio:.3f}); "
            "by part and why (a smaller KV cache can take more weights):")
    return ["", text, "", table(["part", "before", "after", "change", "why"], rows)]


def _flat_metrics(block: Any) -> dict[str, Any]:
    """TASK/METRIC → value from an eval block (`evaluate_model` dict, or the trainer's {"validation": {...}, TASK: {...}});
    a metric with a stderr entry becomes 'value ± stderr'."""
    metrics = block.get("metrics", block) if isinstance(block, dict) else {}
    flat: dict[str, Any] = {}
    for task, values in metrics.items():
        if task == "validation" and isinstance(values, dict):  # the trainer's own measure, under its name
            names = {"token_perplexity": VALIDATION, "loss": "validation loss"}
            ordered = sorted(values.items(), key=lambda kv: kv[0] != "token_perplexity")  # the figure first
            flat.update({names.get(m, f"validation/{m}"): v for m, v in ordered
                         if isinstance(v, (int, float)) and not isinstance(v, bool)})
        elif isinstance(values, dict):
            flat.update({f"{task}/{m}": with_stderr(v, values.get(f"{m}_stderr")) for m, v in shown(task, values).items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)})
        elif isinstance(values, (int, float)) and not isinstance(values, bool):
            flat[str(task)] = values
    return flat


def finetune_section(finetune: dict) -> str:
    """## Healing (fine-tune): the recipe, what trained, and the metrics before and after."""
    recipe = finetune.get("recipe") or {}
    recipe_name = (recipe.get("name") or recipe.get("config")) if isinstance(recipe, dict) else recipe
    curve = [p for p in finetune.get("loss_curve") or [] if isinstance(p, (list, tuple)) and len(p) == 2]
    parts = [
        "## Healing (fine-tune)",
        "",
        table(
            ["", ""],
            [
                ["recipe", scrub(recipe_name)],
                ["model trained", public_name(finetune.get("base_model"), finetune.get("base_model_path"))],
                ["teacher (distillation)", public_name(finetune.get("teacher"), finetune.get("teacher_path"))],
                ["trainable", finetune.get("trainable")],
                ["optimizer steps", finetune.get("steps")],
                ["tokens seen", finetune.get("tokens_seen")],
                ["loss first → last", f"{fmt(curve[0][1])} → {fmt(curve[-1][1])}" if curve else None],
            ],
        ),
    ]
    before, after = _flat_metrics(finetune.get("eval_before")), _flat_metrics(finetune.get("eval_after"))
    if before or after:
        keys = list(dict.fromkeys([*before, *after]))
        parts += ["", "Measured before and after healing:", "", table(["metric", "before", "after"], [[k, before.get(k), after.get(k)] for k in keys])]
        text = finetune.get("validation_text") or {}
        notes = [f"{VALIDATION}: on {validation_text(text.get('rows'), text.get('seq_len'))}."] if VALIDATION in keys else []
        sentence = task_sentence(k.split("/")[0] for k in keys if "/" in k)
        parts += ["", " ".join(notes + ([sentence] if sentence else []))] if notes or sentence else []
        limit = finetune_eval_limit(finetune)
        if limit is not None and any(not k.startswith("validation") for k in keys):
            parts += ["", f"The task metrics above are **partial (eval.limit {limit})**: at most {limit} documents per task, "
                          "so they are indicative only and are not in this card's `model-index`."]
    if isinstance(recipe, dict) and recipe:
        parts += ["", details("Recipe", scrub(recipe))]
    return "\n".join(parts)


def eval_section(eval_results: dict) -> str:
    """## Evaluation: `attnkit eval`'s table against its baseline, said partial when it was."""
    model, baseline, retention = model_metrics(eval_results)
    rows = []
    for task, metrics in model.items():
        base = baseline.get(task) or {}
        for metric, value in shown(task, metrics).items():
            rows.append([task, metric, with_stderr(value, metrics.get(f"{metric}_stderr")),
                         with_stderr(base.get(metric), base.get(f"{metric}_stderr")), (retention.get(task) or {}).get(metric)])
    base_model = (eval_results.get("models") or {}).get("baseline") or {}
    base_name = public_name(base_model.get("name"), base_model.get("path"))
    limit = eval_limit(eval_results)
    this = f"this model, partial (--limit {limit})" if limit is not None else "this model"
    header = ["task", "metric", this, f"baseline ({base_name})" if base_name else "baseline", "retention"]
    intro = "From `attnkit eval` (lm-eval-harness, bundled offline tasks unless named otherwise)"
    if limit is not None:
        intro += (f". **Partial run (--limit {limit})**: at most {limit} documents per task, so these numbers are "
                  "indicative only and are not in this card's `model-index`.")
    else:
        intro += ":"
    sentence = task_sentence(model)
    return "\n".join(["## Evaluation", "", intro, "", table(header, rows), *(["", sentence] if sentence else [])])


def usage_section(remote_code: bool, reports: dict[str, dict | None], repo: str, extra: MethodSections) -> str:
    """## How to load: the snippet, whether it needs remote code, which transformers, then the methods' notes."""
    convert, finetune, config = reports["convert"], reports["finetune"], reports["config"]
    trust = ", trust_remote_code=True" if remote_code else ""
    # AutoTokenizer reads config.json when tokenizer_config.json names no class it knows, and config.json's
    # auto_map then makes it ask whether to run the remote code: the plain class asks nothing.
    tokenizer_class = "PreTrainedTokenizerFast" if remote_code else "AutoTokenizer"
    parts = [
        "## How to load",
        "",
        "```python",
        f"from transformers import AutoModelForCausalLM, {tokenizer_class}",
        "",
        f'tokenizer = {tokenizer_class}.from_pretrained("{repo}")',
        f'model = AutoModelForCausalLM.from_pretrained("{repo}"{trust})',
        "```",
        "",
    ]
    if remote_code:
        code = ("This model needs `trust_remote_code=True`: its attention modules ship with it as Python files "
                "(with attnkit installed, `import attnkit.adapters` registers the same classes and no remote code is "
                "needed). Its tokenizer needs no code: `PreTrainedTokenizerFast` loads it without `trust_remote_code`.")
    else:
        code = "No custom code is needed (no `trust_remote_code`): the architecture is a stock `transformers` one."
    parts.append(f"{code} {_transformers_line(remote_code, convert, finetune, config)}")
    for note in extra.usage_notes:
        parts += ["", note]
    return "\n".join(parts)


def _transformers_line(remote_code: bool, convert: dict | None, finetune: dict | None, config: dict | None) -> str:
    """Which transformers releases load it: the oldest release checked (conversions to a stock
    architecture, docs/compat.md), else only the release that wrote it. A healed folder was re-saved by
    the trainer, so the converter's check no longer speaks for it."""
    min_version = ((convert or {}).get("load") or {}).get("min_transformers")
    if min_version and not remote_code and not finetune:
        return f"Minimum transformers version: **{min_version}** (the oldest release checked to build the same model)."
    written = (config or {}).get("transformers_version")
    if written:
        return f"Saved with transformers {written}; older releases were not checked."
    return "The transformers release it needs was not recorded."
