"""Scoring one model with lm-eval-harness: its tasks through lm-eval's model class
(`scoring.SharedPrefixLM`, which runs each multiple-choice context once), lm-eval's metrics plus the
token perplexity, the item counts and directions, the KV cache measured from the model's real cache
object, and the retention of a model against its baseline."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from attnkit.errors import AttnkitError
from attnkit.evaluation import tasks as bundled
from attnkit.evaluation.load import first_line, load_model
from attnkit.evaluation.present import Progress, quiet

DEFAULT_MAX_LENGTH = 1024  # the reference model's training window; rolling perplexity uses windows of this size


def _task_manager(names: list[str]):
    """lm-eval's TaskManager over the bundled YAMLs (and lm-eval's own index only if a name needs it)."""
    from lm_eval.tasks import TaskManager

    # Indexing lm-eval's own ~15k task files takes minutes on a busy CPU: only when a name needs it.
    defaults = any(n not in bundled.TASKS for n in names)
    manager = TaskManager(include_path=str(bundled.HERE), include_defaults=defaults)
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise AttnkitError(f"unknown task {unknown[0]!r} (bundled: {bundled.known_names()})")
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
    progress: Progress | None = None,
    verbose: bool = False,
) -> dict:
    """Evaluate one model (a MODEL spec or an in-memory model + tokenizer); returns its result dict.

    Without `progress`, a bar of its own is drawn; lm-eval's output is hidden unless `verbose`.
    """
    names = bundled.expand(tasks) if isinstance(tasks, str) else list(tasks)
    bundled.check_names(names)  # before loading anything
    label = name or (str(model_or_path) if isinstance(model_or_path, (str, Path)) else type(model_or_path).__name__)
    with quiet(verbose) as stream:
        own = progress is None
        if own:
            progress = Progress([label], stream)
            progress.start(0)
        ok = False
        try:
            result = evaluate(model_or_path, tokenizer, names, limit, batch_size, dtype, device, max_length, label,
                              progress, verbose)
            ok = True
            return result
        finally:
            if own:
                progress.close(clear=not ok)


def evaluate(model_or_path: Any, tokenizer: Any, names: list[str], limit: int | None, batch_size: int, dtype: str,
             device: str | None, max_length: int, label: str, progress: Progress, verbose: bool = False) -> dict:
    """evaluate_model's work, inside a quiet() block and with a Progress already started for this model."""
    import lm_eval

    from attnkit.evaluation.kv import checkpoint_dtype, kv_as_stored, kv_cache_bytes_per_token, short_dtype
    from attnkit.evaluation.scoring import SharedPrefixLM

    path = None
    if isinstance(model_or_path, (str, Path)):
        model, tokenizer, path = load_model(str(model_or_path), dtype, device)
    else:
        model = model_or_path
        if tokenizer is None:
            raise AttnkitError("evaluate_model needs a tokenizer with an in-memory model")
    progress.phase("tasks")
    manager = _task_manager(names)
    progress.plan(bundled.work_estimate(names, tokenizer, limit, max_length))
    lm = SharedPrefixLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length,
                        progress=progress.update)
    started = time.time()
    progress.phase("scoring")
    try:
        out = lm_eval.simple_evaluate(
            model=lm, tasks=names, task_manager=manager, limit=limit, log_samples=True,
            verbosity="WARNING" if verbose else "ERROR",
            bootstrap_iters=1000,
        )
    except (ConnectionError, OSError) as exc:
        raise AttnkitError(f"a task's dataset cannot be loaded (offline?): {first_line(exc)}") from None
    metrics = {task: _metrics(out["results"][task]) for task in names if task in out["results"]}
    higher = {task: dict(out.get("higher_is_better", {}).get(task, {})) for task in metrics}
    for task in metrics:
        if task.startswith("attnkit-ppl"):
            metrics[task]["token_perplexity"] = _token_perplexity(out["samples"][task], tokenizer)
            higher[task]["token_perplexity"] = False
    counts = {task: int(out.get("n-samples", {}).get(task, {}).get("effective", len(out["samples"].get(task, []))))
              for task in metrics}
    progress.phase("KV cache")
    kv = kv_cache_bytes_per_token(model)
    progress.finish()
    run_dtype = next(model.parameters()).dtype
    stored = (checkpoint_dtype(path) if path else None) or short_dtype(run_dtype)
    return {
        "name": label,
        "path": str(path) if path else None,
        "model_type": getattr(model.config, "model_type", None),
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": str(run_dtype).replace("torch.", ""),
        # counted in the dtype the checkpoint is stored in, as convert and bench count it (kv.py)
        "kv_cache_bytes_per_token": kv_as_stored(kv["total"], kv["dtype"], stored)["bytes_per_token"],
        "kv_cache_bytes_per_token_per_layer": [kv_as_stored(b, kv["dtype"], stored)["bytes_per_token"]
                                               for b in kv["per_layer"]],
        "kv_cache_dtype": kv_as_stored(kv["total"], kv["dtype"], stored)["dtype"],
        "kv_cache_measured": {"bytes_per_token": kv["total"], "dtype": short_dtype(kv["dtype"]),
                              "per_layer": kv["per_layer"]},
        "kv_cache_class": kv.get("layer_class"),
        "seconds": round(time.time() - started, 1),
        "metrics": metrics,
        "n": counts,
        "higher_is_better": higher,
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
    # the KV ratio from the caches this run measured (both in --dtype), whatever dtypes the checkpoints are stored in
    out["kv_cache_bytes_per_token"] = _measured_kv(model) / _measured_kv(baseline)
    out["params"] = model["params"] / baseline["params"]
    return out


def _measured_kv(model: dict) -> int:
    return (model.get("kv_cache_measured") or {}).get("bytes_per_token", model["kv_cache_bytes_per_token"])


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat; None where there is no /proc."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def eval_threads(sample_s: float = 0.2, most: int | None = None) -> int | None:
    """torch CPU threads for this model's evaluation: fewer when other processes keep the CPUs busy now.

    Why: with torch's default (one thread per core), every op waits for all its threads; when other
    jobs hold the cores, that wait is a scheduler time slice per op. Measured on 2 cores at load ~12:
    `attnkit eval reference` took 246 s with 2 threads and 34 s with 1. On an idle machine the default
    stays. `most`: the upper bound (default: torch's current setting). None: leave torch alone
    (OMP_NUM_THREADS set, one core, or no /proc to measure).
    """
    default = most or torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS") or default <= 1:
        return None
    first = _cpu_ticks()
    time.sleep(sample_s)  # this process sleeps: what is busy meanwhile is someone else
    second = _cpu_ticks()
    if first is None or second is None or second[1] <= first[1]:
        return None
    cpus = os.cpu_count() or 1
    others = cpus * (second[0] - first[0]) / (second[1] - first[1])  # cores kept busy by other processes
    return max(1, min(default, round(cpus - others)))
