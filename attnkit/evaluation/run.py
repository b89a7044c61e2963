"""`attnkit eval`: lm-eval-harness on bundled offline tasks (or any lm-eval task), side by side.

Models are evaluated in memory through `HFLM(pretrained=model)`, so a converted model is measured
exactly as `from_pretrained` loads it (remote code included). Besides lm-eval's metrics each model
gets its parameter count and KV-cache bytes per token measured from its real cache object.
The JSON schema is documented in docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from attnkit import __version__
from attnkit.errors import AttnkitError
from attnkit.evaluation import tasks as bundled
from attnkit.io.resolve import check_causal_lm, resolve_model

SCHEMA = "attnkit.eval/v1"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_MAX_LENGTH = 1024  # the reference model's training window; rolling perplexity uses windows of this size


def load_model(spec: str, dtype: str = "fp32", device: str | None = None):
    """MODEL spec → (model, tokenizer, path), with one-line errors for every way a folder can be wrong."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(spec)
    config = check_causal_lm(path)
    remote = "auto_map" in config
    if remote:
        import attnkit.adapters  # noqa: F401  (registers attnkit's DEX/DIFF classes)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=remote)
    except Exception as exc:
        raise AttnkitError(f"cannot load the tokenizer of {spec}: {_first_line(exc)}") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], trust_remote_code=remote)
    except Exception as exc:
        raise AttnkitError(f"cannot load {spec} as a causal LM: {_first_line(exc)}") from None
    model.to(_device(device)).eval()
    return model, tokenizer, path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def _device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise AttnkitError("--device cuda was given but no CUDA device is available")
    return torch.device(device)


def _task_manager(names: list[str], folder: Path):
    from lm_eval.tasks import TaskManager

    bundled.render(names, folder)
    # Indexing lm-eval's own ~15k task files takes minutes on a busy CPU: only when a name needs it.
    defaults = any(n not in bundled.BUNDLED for n in names)
    manager = TaskManager(include_path=str(folder), include_defaults=defaults)
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise AttnkitError(f"unknown task {unknown[0]!r} (bundled: {', '.join(bundled.BUNDLED)}, attnkit-core)")
    return manager


def _metrics(task_results: dict) -> dict[str, float]:
    """lm-eval's 'acc,none' keys → 'acc'; drops non-numeric entries such as the alias."""
    out = {}
    for key, value in task_results.items():
        metric, _, filt = key.partition(",")
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if numeric and filt in ("none", "") and metric != "sample_len":
            out[metric] = float(value)
    return out


def _token_perplexity(samples: list[dict], tokenizer) -> float:
    """exp(−Σ log p / Σ tokens) over the rolling-loglikelihood documents lm-eval scored."""
    total_ll, total_tokens = 0.0, 0
    for s in samples:
        ll = s["filtered_resps"][0]
        total_ll += float(ll[0] if isinstance(ll, (list, tuple)) else ll)
        total_tokens += len(tokenizer(s["doc"]["text"], add_special_tokens=False)["input_ids"])
    return math.exp(-total_ll / max(total_tokens, 1))


def evaluate_model(
    model_or_path: Any,
    tokenizer=None,
    tasks: str | list[str] = "attnkit-core",
    limit: int | None = None,
    batch_size: int = 4,
    dtype: str = "fp32",
    device: str | None = None,
    max_length: int = DEFAULT_MAX_LENGTH,
    name: str | None = None,
) -> dict:
    """Evaluate one model (a MODEL spec or an in-memory model + tokenizer); returns its result dict."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from attnkit.evaluation.kv import kv_cache_bytes_per_token

    names = bundled.expand(tasks) if isinstance(tasks, str) else list(tasks)
    bundled.check_names(names)  # before loading anything
    path = None
    if isinstance(model_or_path, (str, Path)):
        name = name or str(model_or_path)
        model, tokenizer, path = load_model(str(model_or_path), dtype, device)
    else:
        model = model_or_path
        if tokenizer is None:
            raise AttnkitError("evaluate_model needs a tokenizer with an in-memory model")
    with tempfile.TemporaryDirectory(prefix="attnkit-tasks-") as folder:
        manager = _task_manager(names, Path(folder))
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
        started = time.time()
        try:
            out = lm_eval.simple_evaluate(
                model=lm, tasks=names, task_manager=manager, limit=limit, log_samples=True, verbosity="ERROR",
                bootstrap_iters=1000,
            )
        except (ConnectionError, OSError) as exc:
            raise AttnkitError(f"a task's dataset cannot be loaded (offline?): {_first_line(exc)}") from None
    metrics = {task: _metrics(out["results"][task]) for task in names if task in out["results"]}
    if "attnkit-ppl" in metrics:
        metrics["attnkit-ppl"]["token_perplexity"] = _token_perplexity(out["samples"]["attnkit-ppl"], tokenizer)
    kv = kv_cache_bytes_per_token(model)
    return {
        "name": name or type(model).__name__,
        "path": str(path) if path else None,
        "model_type": getattr(model.config, "model_type", None),
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "kv_cache_bytes_per_token": kv["total"],
        "kv_cache_bytes_per_token_per_layer": kv["per_layer"],
        "kv_cache_class": kv.get("layer_class"),
        "seconds": round(time.time() - started, 1),
        "metrics": metrics,
    }


def retention(model: dict, baseline: dict) -> dict[str, float]:
    """model ÷ baseline for every shared metric (stderr excluded); for perplexities > 1 is worse."""
    out = {}
    for task, metrics in model["metrics"].items():
        for metric, value in metrics.items():
            base = baseline["metrics"].get(task, {}).get(metric)
            if base is None or metric.endswith("_stderr"):
                continue
            out[f"{task}/{metric}"] = value / base if base else None
    for key in ("kv_cache_bytes_per_token", "params"):
        out[key] = model[key] / baseline[key]
    return out


MAIN_METRICS = {"attnkit-ppl": ["token_perplexity", "byte_perplexity", "bits_per_byte"]}


def _rows(result: dict) -> list[tuple[str, str]]:
    rows = []
    for task, metrics in result["models"]["model"]["metrics"].items():
        keep = MAIN_METRICS.get(task, ["acc", "acc_norm"]) if task.startswith("attnkit-") else list(metrics)
        rows += [(task, m) for m in keep if m in metrics and not m.endswith("_stderr")]
    return rows


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def format_table(result: dict) -> str:
    models = result["models"]
    has_base = "baseline" in models
    header = ["task", "metric", "model"] + (["baseline", "retention"] if has_base else [])
    lines = []
    for task, metric in _rows(result):
        row = [task, metric, f"{models['model']['metrics'][task][metric]:.4f}"]
        if has_base:
            row += [f"{models['baseline']['metrics'][task][metric]:.4f}", _ratio(result["retention"].get(f"{task}/{metric}"))]
        lines.append(row)
    for key, label in (("kv_cache_bytes_per_token", "KV bytes/token"), ("params", "parameters")):
        row = ["model", label, f"{models['model'][key]:,}"]
        if has_base:
            row += [f"{models['baseline'][key]:,}", _ratio(result["retention"][key])]
        lines.append(row)
    widths = [max(len(str(r[i])) for r in [header, *lines]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def main(args: argparse.Namespace) -> int:
    if args.out:
        out = Path(args.out)
        if out.is_dir():
            raise AttnkitError(f"--out {out} is a folder; give a file name such as results.json")
    names = bundled.expand(args.tasks)
    kwargs = dict(tasks=names, limit=args.limit, batch_size=args.batch_size, dtype=args.dtype, device=args.device)
    result: dict[str, Any] = {"schema": SCHEMA, "attnkit_version": __version__, "tasks": names, "limit": args.limit}
    models = {"model": evaluate_model(args.model, **kwargs)}
    if args.baseline:
        models["baseline"] = evaluate_model(args.baseline, **kwargs)
        result["retention"] = retention(models["model"], models["baseline"])
    result["models"] = models
    print(format_table(result))
    if args.out:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(out)
        print(f"wrote {out}")
    return 0
