"""`attnkit convert`: dispatch `--to` to the pipeline that implements it; with `--eval`, evaluate
the written model against its source in the same process afterwards."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnkit.cli import load_handler
from attnkit.errors import AttnkitError

PIPELINES = {
    "mla": "attnkit.converters.mla.convert:convert",
    "dex": "attnkit.converters.dex.convert:convert_dex",
    "diff": "attnkit.converters.diff.convert:convert_diff",
    "mla+dex": "attnkit.converters.dex.convert:convert_mla_dex",
    "titans": "attnkit.converters.titans.convert:convert_titans",
    "mla+titans": "attnkit.converters.titans.convert:convert_mla_titans",
    "gqa": "attnkit.converters.gqa.convert:convert",
}


def eval_args(args: argparse.Namespace) -> argparse.Namespace:
    """What `attnkit eval OUT --baseline MODEL --tasks TASKS --out OUT/eval_results.json` would parse
    to: the results land where `attnkit push` reads them for the model card."""
    from attnkit.io.model_card import EVAL_RESULTS

    return argparse.Namespace(model=args.out, baseline=args.model, tasks=args.tasks, limit=None, batch_size=4,
                              dtype="fp32", device=args.device, out=str(Path(args.out) / EVAL_RESULTS), verbose=False)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "eval", False):  # the task names are checked before any conversion work
        from attnkit.evaluation import tasks as bundled

        names = bundled.expand(args.tasks)
        if not names:
            raise AttnkitError("--tasks names no task")
        bundled.check_names(names)
    rc = load_handler(PIPELINES[args.to], f"attnkit convert --to {args.to}")(args) or 0
    if rc or not getattr(args, "eval", False):
        return rc
    # one process for both: the imports and the source's tokenizer are not paid twice (the README's first command)
    from attnkit.converters.measure import end_conversion_memory_policy
    from attnkit.evaluation.run import main as evaluate
    from attnkit.io.model_card import write_model_card

    end_conversion_memory_policy()
    try:
        rc = evaluate(eval_args(args))
    except AttnkitError as exc:
        raise AttnkitError(f"{args.out} was written; its evaluation failed: {exc}") from None
    write_model_card(Path(args.out))  # the card now states the evaluation too
    return rc
