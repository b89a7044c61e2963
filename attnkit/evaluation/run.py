"""`attnkit eval`: lm-eval-harness on bundled offline tasks (or any lm-eval task), side by side.

Models are evaluated in memory through lm-eval's `HFLM(pretrained=model)` — the subclass
`scoring.SharedPrefixLM`, which runs each multiple-choice context once instead of once per choice
(same figures, a fraction of the compute) — so a converted model is measured exactly as
`from_pretrained` loads it (remote code included). Besides lm-eval's metrics each model gets its
parameter count and KV-cache bytes per token measured from its real cache object, the item count
behind each task and lm-eval's direction (higher/lower is better) per metric.
The JSON schema is documented in docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, TextIO

import torch

from attnkit import __version__
from attnkit.errors import AttnkitError
from attnkit.sdpa import implementation_for
from attnkit.evaluation import ppl as ppl_names
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
        fused = implementation_for(config)  # MLA's q/k vs v head sizes: SDPA's fused kernels, V zero-padded
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], trust_remote_code=remote,
                                                     **({"attn_implementation": fused} if fused else {}))
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


class Progress:
    """One progress bar over every model of an `attnkit eval` run: which model, what it does, overall ETA.

    Units are tokens through the model (what the time goes into); each model's total is estimated
    from the bundled task data before it runs, and a model not started yet is assumed to cost what
    the current one does, so the ETA covers the whole run from the first model on.
    """

    def __init__(self, labels: list[str], stream: TextIO | None = None, disable: bool = False) -> None:
        from tqdm import tqdm

        self.labels = labels
        self.planned = [0] * len(labels)  # tokens per model: estimate, then what was really done
        self.done = [0] * len(labels)
        self.index = 0
        self.bar = tqdm(total=0, desc=f"[1/{len(labels)}] {labels[0]}", unit="tok", unit_scale=True,
                        file=stream or sys.stderr, disable=disable,
                        mininterval=0.5, dynamic_ncols=True, bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                        "{n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]{postfix}")

    def _total(self) -> int:
        current = self.planned[self.index]
        later = [p or current for p in self.planned[self.index + 1 :]]
        return sum(self.planned[: self.index + 1]) + sum(later)

    def start(self, index: int, phase: str = "loading") -> None:
        self.index = index
        self.bar.set_description_str(f"[{index + 1}/{len(self.labels)}] {self.labels[index]}", refresh=False)
        self.phase(phase)

    def phase(self, what: str) -> None:
        self.bar.set_postfix_str(what, refresh=True)

    def plan(self, tokens: int) -> None:
        """The current model's estimated work in tokens."""
        self.planned[self.index] = max(tokens, self.done[self.index])
        self.bar.total = self._total()
        self.bar.refresh()

    def update(self, tokens: int) -> None:
        self.done[self.index] += tokens
        if self.done[self.index] > self.planned[self.index]:  # beyond the estimate: the total follows, quietly
            self.planned[self.index] = self.done[self.index]
            self.bar.total = self._total()
        self.bar.update(tokens)  # redraws at most every `mininterval`

    def finish(self) -> None:
        """The current model is done: its real work replaces the estimate."""
        self.planned[self.index] = self.done[self.index]
        self.bar.total = self._total()
        self.phase("done")

    def close(self, clear: bool = False) -> None:
        """Close the bar; `clear` removes it from the terminal (an error message follows instead)."""
        if clear:
            self.bar.leave = False
        self.bar.close()


_NOISY_LOGGERS = ("lm_eval", "lm-eval", "datasets", "transformers", "accelerate", "huggingface_hub", "root")


@contextlib.contextmanager
def quiet(verbose: bool) -> Iterator[TextIO]:
    """Hide lm-eval's and its libraries' warnings, logs and bars unless `verbose`; yields the real stderr.

    File descriptors 1 and 2 are redirected into a temporary file (a subprocess such as lm-eval's
    `git describe` writes "fatal: not a git repository" to fd 2 directly), library loggers are set
    to ERROR and Python warnings are ignored. `sys.stderr` itself is not swapped: lm-eval binds its
    log handler to the `sys.stderr` it first sees, and a swapped-in stream would be closed later.
    What was hidden is shown if an unexpected error escapes (an AttnkitError is one line of its own).
    """
    if verbose:
        yield sys.stderr
        return
    import warnings

    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    real = os.fdopen(os.dup(saved[2]), "w", buffering=1, encoding="utf-8", errors="replace")
    log = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
    levels = {name: logging.getLogger(name).level for name in _NOISY_LOGGERS}
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield real
    except (AttnkitError, KeyboardInterrupt):
        raise
    except BaseException:
        log.flush()
        log.seek(0)
        hidden = log.read().strip().splitlines()
        if hidden:
            real.write("attnkit: what lm-eval logged before the error (last lines):\n" + "\n".join(hidden[-30:]) + "\n")
        raise
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        real.close()
        log.close()


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
            result = _evaluate(model_or_path, tokenizer, names, limit, batch_size, dtype, device, max_length, label,
                               progress, verbose)
            ok = True
            return result
        finally:
            if own:
                progress.close(clear=not ok)


def _evaluate(model_or_path: Any, tokenizer: Any, names: list[str], limit: int | None, batch_size: int, dtype: str,
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
        raise AttnkitError(f"a task's dataset cannot be loaded (offline?): {_first_line(exc)}") from None
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


MAIN_METRICS = ppl_names.MAIN_METRICS  # of the attnkit-ppl tasks


def _rows(result: dict) -> list[tuple[str, str]]:
    """(task, metric) rows of the printed table; the model card shows the same (ppl.shown_metrics)."""
    return [(task, m) for task, metrics in result["models"]["model"]["metrics"].items()
            for m in ppl_names.shown_metrics(task, metrics)]


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _better(model: dict, task: str, metric: str) -> str:
    """'higher' / 'lower' (which way is better), '?' when lm-eval did not say."""
    flag = model.get("higher_is_better", {}).get(task, {}).get(metric)
    return "?" if flag is None else ("higher" if flag else "lower")


NOTE = "better: which way is better. n: items (perplexity: documents) behind each figure."
RETENTION_NOTE = "retention = model / baseline: a loss is < 1 where higher is better, > 1 where lower is better."


def _kv_rows(models: dict) -> list[tuple[str, dict[str, str]]]:
    """The table's KV rows: bytes/token as stored (the figure convert and bench print), and as this run
    measured it when it ran in another dtype; the dtype in the label, or beside each figure when they differ."""
    from attnkit.evaluation.kv import short_dtype

    stored = {role: (m["kv_cache_bytes_per_token"], short_dtype(m.get("kv_cache_dtype") or m["dtype"]))
              for role, m in models.items()}
    measured = {role: (m["kv_cache_measured"]["bytes_per_token"], m["kv_cache_measured"]["dtype"])
                for role, m in models.items() if m.get("kv_cache_measured")}
    rows = [("as stored", stored)]
    if measured and measured != stored:
        rows.append(("in this run", measured))
    out = []
    for how, figures in rows:
        dtypes = {dt for _, dt in figures.values()}
        one = len(dtypes) == 1
        label = f"KV bytes/token ({next(iter(dtypes))}, {how})" if one else f"KV bytes/token ({how})"
        out.append((label, {role: f"{n:,}" if one else f"{n:,} {dt}" for role, (n, dt) in figures.items()}))
    return out


def format_table(result: dict) -> str:
    """The printed table: per metric the direction, the item count, each model's value and the retention."""
    models = result["models"]
    model = models["model"]
    has_base = "baseline" in models
    header = ["task", "metric", "better", "n", "model"] + (["baseline", "retention"] if has_base else [])
    lines = []
    for task, metric in _rows(result):
        n = model.get("n", {}).get(task)
        row = [task, metric, _better(model, task, metric), "" if n is None else str(n)]
        row.append(f"{model['metrics'][task][metric]:.4f}")
        if has_base:
            row.append(f"{models['baseline']['metrics'][task][metric]:.4f}")
            row.append(_ratio(result["retention"].get(f"{task}/{metric}")))
        lines.append(row)
    for label, figures in _kv_rows(models):
        row = ["model", label, "lower", "", figures["model"]]
        if has_base:
            row += [figures["baseline"], _ratio(result["retention"]["kv_cache_bytes_per_token"])]
        lines.append(row)
    row = ["model", "parameters", "", "", f"{model['params']:,}"]
    if has_base:
        row += [f"{models['baseline']['params']:,}", _ratio(result["retention"]["params"])]
    lines.append(row)
    widths = [max(len(str(r[i])) for r in [header, *lines]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:  # text columns left-aligned, numbers right-aligned
        return "  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    table = [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, lines)]
    sentence = ppl_names.task_sentence(model["metrics"])
    return "\n".join([*table, NOTE, *([RETENTION_NOTE] if has_base else []), *([sentence] if sentence else [])])


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


def check_inputs(specs: list[str]) -> None:
    """Resolve and check every MODEL spec before any model is loaded or evaluated (one-line errors);
    weights whose shapes contradict the config are named here, not in transformers' load report, and so
    is a NaN/Inf weight (its perplexity would be nan beside accuracies that look normal)."""
    from attnkit.converters.shapes import check_weights
    from attnkit.io.checkpoint import check_finite

    paths = []
    for spec in specs:
        path = resolve_model(spec)
        config = check_causal_lm(path)
        check_weights(path, config, required=False, where=f"cannot load {spec}")
        paths.append(path)
    for spec, path in zip(specs, paths):  # reads every weight: after the header-only checks of all of them
        check_finite(path, spec)


def evaluate_all(specs: dict[str, Any], names: list[str], limit: int | None, batch_size: int, dtype: str,
                 device: str | None, verbose: bool = False, tokenizers: dict[str, Any] | None = None) -> dict:
    """Each model of `specs` ({"model": ..., "baseline": ...}: MODEL specs, or in-memory models with their
    `tokenizers`) under one progress bar; with a baseline, the retention. The result `attnkit eval` writes."""
    tokenizers = tokenizers or {}
    result: dict[str, Any] = {"schema": SCHEMA, "attnkit_version": __version__, "tasks": names, "limit": limit}
    labels = {role: spec if isinstance(spec, (str, Path)) else f"{role} ({type(spec).__name__})"
              for role, spec in specs.items()}
    models = {}
    with quiet(verbose) as stream:
        progress = Progress([str(v) for v in labels.values()], stream)
        ok, threads_before = False, torch.get_num_threads()
        try:
            for i, (role, spec) in enumerate(specs.items()):
                progress.start(i)
                torch.set_num_threads(eval_threads(most=threads_before) or threads_before)
                models[role] = _evaluate(spec, tokenizers.get(role), names, limit, batch_size, dtype, device,
                                         DEFAULT_MAX_LENGTH, str(labels[role]), progress, verbose)
                models[role]["torch_threads"] = torch.get_num_threads()
            ok = True
        finally:
            torch.set_num_threads(threads_before)  # also run in-process (tests, notebooks)
            progress.close(clear=not ok)
    if "baseline" in models:
        result["retention"] = retention(models["model"], models["baseline"])
    result["models"] = models
    return result


def main(args: argparse.Namespace) -> int:
    """The `attnkit eval` handler."""
    run_eval(args)
    return 0


def run_eval(args: argparse.Namespace) -> dict:
    """`attnkit eval`: check every input, evaluate each model under one progress bar, print the table, write
    JSON; returns the results."""
    args.verbose = getattr(args, "verbose", False)
    out = Path(args.out) if args.out else None
    if out is not None and out.is_dir():
        raise AttnkitError(f"--out {out} is a folder; give a file name such as results.json")
    if out is not None:
        from attnkit.io.checkpoint import check_can_write, check_results_file

        check_results_file(out, SCHEMA, "eval")
        check_can_write(out)  # now, not after the whole evaluation
    names = bundled.expand(args.tasks)
    bundled.check_names_without_index(names)  # a misspelt task now, not after loading lm-eval's index
    specs = {"model": args.model, **({"baseline": args.baseline} if args.baseline else {})}
    check_inputs(list(specs.values()))  # a missing --baseline fails now, not after the model's evaluation
    result = evaluate_all(specs, names, args.limit, args.batch_size, args.dtype, args.device, args.verbose)
    print(format_table(result))
    if out is not None:
        from attnkit.io.public import public_report

        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        public = public_report("eval_results.json", result, out.parent)  # names, no absolute paths: it is uploaded
        tmp.write_text(json.dumps(public, indent=2) + "\n")
        tmp.replace(out)
        print(f"wrote {out}")
    return result
