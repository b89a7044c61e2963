"""`attnkit convert`: dispatch `--to` to the method's converter (`attnkit.registry`); with `--eval`,
evaluate the written model against its source in the same process afterwards."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnkit import registry
from attnkit.cli import load_handler
from attnkit.errors import AttnkitError

def eval_args(args: argparse.Namespace) -> argparse.Namespace:
    """What `attnkit eval OUT --baseline MODEL --tasks TASKS --out OUT/eval_results.json` would parse
    to: the results land where `attnkit push` reads them for the model card."""
    from attnkit.card.reports import EVAL_RESULTS

    return argparse.Namespace(model=args.out, baseline=args.model, tasks=args.tasks, limit=getattr(args, "limit", None),
                              batch_size=4, dtype="fp32", device=args.device, out=str(Path(args.out) / EVAL_RESULTS), verbose=False)


TOKENIZER_GLOBS = ("tokenizer*", "vocab*", "merges.txt", "*.model", "*.tiktoken", "spiece*", "sentencepiece*")


def check_tokenizer_files(path: Path, spec: str) -> None:
    """Every method calibrates on text with the source's tokenizer: when a method could not load it and
    the folder has no tokenizer file at all, that is said in one whole line (transformers' own message
    spans several lines and its first one ends mid-sentence, "...from one of: "). Called after the
    method's refusal, so its checks of the config and weights keep their order."""
    if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_GLOBS):
        raise AttnkitError(f"cannot load the tokenizer of {spec} (needed for calibration): the folder has no tokenizer "
                           "files (tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, ...); copy those "
                           "of the model it was trained from into it")


def main(args: argparse.Namespace) -> int:
    if getattr(args, "eval", False):  # the task names are checked before any conversion work
        from attnkit.evaluation import tasks as bundled

        names = bundled.expand(args.tasks)
        if not names:
            raise AttnkitError("--tasks names no task")
        bundled.check_names_without_index(names)
    from attnkit.converters.common import check_calib_source
    from attnkit.converters.options import calib_seq_len
    from attnkit.io.checkpoint import check_finite
    from attnkit.io.resolve import resolve_model

    args.calib_seq_len = calib_seq_len(args)  # 512, or the fit's 1024 (`options.calib_seq_len`)

    check_calib_source(args.calib)
    path = resolve_model(args.model)
    if any(path.glob("*.safetensors")):  # a folder without weights is the method's to refuse, after its config checks
        check_finite(path, args.model)  # reads every weight: last; a NaN/Inf weight fails here, not midway through a method
    try:
        rc = load_handler(registry.get(args.to).converter, f"attnkit convert --to {args.to}")(args) or 0
    except AttnkitError as exc:
        if "tokenizer" in str(exc):
            check_tokenizer_files(path, args.model)  # the whole reason where there is no tokenizer at all
        raise
    if rc or not getattr(args, "eval", False):
        return rc
    # one process for both: the imports and the source's tokenizer are not paid twice (the README's first command)
    from attnkit.converters.measure import end_conversion_memory_policy
    from attnkit.evaluation.run import main as evaluate
    from attnkit.card.build import write_model_card

    end_conversion_memory_policy()
    try:
        rc = evaluate(eval_args(args))
    except AttnkitError as exc:
        raise AttnkitError(f"{args.out} was written; its evaluation failed: {exc}") from None
    write_model_card(Path(args.out))  # the card now states the evaluation too
    return rc
