"""`attnkit eval`: lm-eval-harness on bundled offline tasks (or any lm-eval task), side by side.

Models are evaluated in memory through lm-eval's `HFLM(pretrained=model)` — the subclass
`scoring.SharedPrefixLM`, which runs each multiple-choice context once instead of once per choice
(same figures, a fraction of the compute) — so a converted model is measured exactly as
`from_pretrained` loads it (remote code included). Besides lm-eval's metrics each model gets its
parameter count and KV-cache bytes per token measured from its real cache object, the item count
behind each task and lm-eval's direction (higher/lower is better) per metric.
The JSON schema is documented in docs/evaluation.md.

This module is the run: check every input, score each model under one bar, print, write. The parts
are `load` (models and their checks), `score` (one model through lm-eval, retention) and `present`
(the bar, the quiet output, the table).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from attnkit import __version__
from attnkit.errors import AttnkitError
from attnkit.evaluation import tasks as bundled
from attnkit.evaluation.load import check_inputs
from attnkit.evaluation.present import Progress, format_table, quiet
from attnkit.evaluation.score import DEFAULT_MAX_LENGTH, eval_threads, evaluate, retention

SCHEMA = "attnkit.eval/v1"


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
                models[role] = evaluate(spec, tokenizers.get(role), names, limit, batch_size, dtype, device,
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
