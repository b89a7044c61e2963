"""What `attnkit eval` shows: one progress bar over every model of a run, lm-eval's and its libraries'
noise hidden (shown only when an unexpected error escapes), and the printed table."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from typing import Iterator, TextIO

from attnkit.errors import AttnkitError
from attnkit.evaluation import ppl as ppl_names


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


# ---------------------------------------------------------------- the table


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
