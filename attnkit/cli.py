"""The `attnkit` command line: one parser, one handler per sub-command.

Handlers are named as "module:function" and imported only when their sub-command runs, so
`attnkit --help` is fast and a broken optional dependency affects only its own command.
Every handler takes the parsed `argparse.Namespace`; it raises `AttnkitError` for bad input,
which `main` turns into a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from pathlib import Path

from attnkit.errors import AttnkitError

HANDLERS = {
    "convert": "attnkit.converters.run:main",
    "finetune": "attnkit.training.finetune:main",
    "eval": "attnkit.evaluation.run:main",
    "bench": "attnkit.evaluation.bench:main",
    "push": "attnkit.io.hub:main",
    "pretrain": "attnkit.training.pretrain:main",
    "tasks": "attnkit.evaluation.tasks:main",
}

MODEL_HELP = "a Hub id (owner/name), a local folder, or `reference` / `reference-qwen3` for a bundled model"


def _add_convert(sub) -> None:
    """The options come from the option classes (`attnkit/options.py`): the common ones, then one group
    per class the registered methods read (`attnkit/registry.py`)."""
    from attnkit import registry
    from attnkit.converters.options import ConvertOptions
    from attnkit.options import add_arguments

    methods = registry.methods()
    p = sub.add_parser(
        "convert",
        help="rewrite a checkpoint's attention (MLA, DEX, DIFF, fewer KV heads)",
        description="Rewrite the attention of MODEL and write a new checkpoint into OUT (atomically).\n\nmethods:\n"
        + "\n".join(f"  {m.name:<11} {m.help}" for m in methods.values()),
        epilog="example:\n  attnkit convert --to mla reference -o out/ref-mla --kv-lora-rank 28 --rope-dim 48 --eval\n"
        "  attnkit convert --to dex reference -o out/ref-dex --heads auto\n"
        "  attnkit convert --to gqa reference -o out/ref-mqa --kv-heads 1",
    )
    p.add_argument("--to", required=True, choices=list(methods), help="target attention (see methods above)")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("-o", "--out", required=True, metavar="OUT", help="output folder (must be empty or absent)")
    add_arguments(p, ConvertOptions)
    for cls in registry.option_classes():
        if cls.GROUP:
            add_arguments(p.add_argument_group(cls.GROUP), cls)


def _add_recipe_args(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument("--config", required=True, help=f"YAML recipe, e.g. {example}")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="override recipe keys (dotted keys allowed)")


def _add_finetune(sub) -> None:
    p = sub.add_parser(
        "finetune",
        help="heal a converted model (one process; use `accelerate launch -m attnkit.finetune` for several)",
        description="Fine-tune a converted model from a YAML recipe; `key=value` overrides follow the config.",
        epilog="example:\n  attnkit finetune --config recipes/heal-mla.yaml model=out/ref-mla output_dir=out/ref-mla-healed",
    )
    _add_recipe_args(p, "recipes/heal-mla.yaml")


def _add_measured_models(p: argparse.ArgumentParser, options: type, baseline_help: str) -> None:
    """MODEL and --baseline, what `eval` and `bench` both take, then the command's option class."""
    from attnkit.options import add_arguments

    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--baseline", metavar="MODEL", default=None, help=baseline_help)
    add_arguments(p, options)


def _add_eval(sub) -> None:
    from attnkit.evaluation.options import EvalOptions

    p = sub.add_parser(
        "eval",
        help="measure quality with lm-eval-harness (offline bundled tasks by default)",
        description="Evaluate MODEL (and --baseline) on lm-eval tasks; print a table, write JSON.",
        epilog="example:\n  attnkit eval out/ref-mla --baseline reference --tasks attnkit-core --out results.json",
    )
    _add_measured_models(p, EvalOptions, "a second model; retention = model / baseline")
    p.add_argument("--out", default=None, metavar="FILE", help="write results JSON here")


def _add_bench(sub) -> None:
    from attnkit.evaluation.options import BenchOptions

    p = sub.add_parser(
        "bench",
        help="measure prefill/decode speed, peak memory and KV-cache bytes",
        description="Benchmark MODEL (and --baseline) at several context lengths and batch sizes.",
        epilog="example:\n  attnkit bench out/ref-mla --baseline reference --context 1024,4096",
    )
    _add_measured_models(p, BenchOptions, "a second model measured side by side")
    p.add_argument("--out", default=None, metavar="FILE", help="write results JSON (and a PNG beside it)")


def _add_push(sub) -> None:
    p = sub.add_parser(
        "push",
        help="upload a converted/healed folder to the Hub with a model card",
        description="Upload OUT to a Hub repository; the model card (README.md) is written from OUT's reports.",
        epilog="example:\n  attnkit push out/ref-mla-healed --repo-id you/ref-mla-healed --private",
    )
    p.add_argument("folder", metavar="OUT", help="a folder written by attnkit convert/finetune")
    p.add_argument("--repo-id", required=True, metavar="USER/NAME", help="target repository")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--revision", default=None, metavar="BRANCH", help="branch to push to")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    p.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login)")
    p.add_argument("--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)")


def _add_pretrain(sub) -> None:
    p = sub.add_parser(
        "pretrain",
        help="train the bundled reference model (tokenizer + small GQA Llama) from a recipe",
        description="Train the reference model; resumable from the last checkpoint in its run folder.",
        epilog="example:\n  attnkit pretrain --config recipes/reference.yaml",
    )
    _add_recipe_args(p, "recipes/reference.yaml")


def _add_tasks(sub) -> None:
    p = sub.add_parser(
        "tasks",
        help="where the bundled lm-eval tasks are (for lm_eval --include_path)",
        description="Print the folder of attnkit's ready lm-eval task YAMLs, for lm-eval's own CLI (--include_path).",
        epilog='example:\n  attnkit tasks path\n'
        '  lm_eval --model hf --model_args pretrained=out/ref-mla --include_path "$(attnkit tasks path)" --tasks attnkit-core',
    )
    p.add_argument("action", choices=["path"], help="path: print the folder")


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line (and exit 2), not the usage block followed by the error; every
    option's default is shown in --help and the epilog (an example) keeps its lines."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default unless its help already says it or there is none (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.option_strings and default is not None and default is not False
                and default is not argparse.SUPPRESS and "default" not in text):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attnkit",
        description="Retrofit the attention of pretrained Hugging Face LMs (GQA/MHA -> MLA, DEX, DIFF), "
        "heal, evaluate and publish them.",
    )
    from attnkit import __version__

    parser.add_argument("--version", action="version", version=f"attnkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_convert, _add_finetune, _add_eval, _add_bench, _add_push, _add_pretrain, _add_tasks):
        add(sub)
    return parser


def load_handler(spec: str, label: str):
    """Import "module:function" lazily; an attnkit module that is not there is a one-line error."""
    module_name, func = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("attnkit"):
            raise AttnkitError(f"`{label}` is not available yet in this version") from None
        raise
    return getattr(module, func)


def check_arguments(args: argparse.Namespace) -> None:
    """Numbers argparse takes as plain ints but the commands cannot use: one line before any work."""
    from attnkit.evaluation.options import BenchOptions, EvalOptions, at_least
    from attnkit.options import from_namespace

    if args.command == "eval":
        from_namespace(EvalOptions, args).check()
    elif args.command == "bench":
        from_namespace(BenchOptions, args).check()
        if args.out:
            from attnkit.io.checkpoint import check_can_write

            check_can_write(args.out)  # now, not after the whole benchmark
    elif args.command == "convert":
        at_least("--limit", args.limit, 1, "a positive number of documents per task (leave it out for all)")
        if args.limit is not None and not args.eval:
            raise AttnkitError("--limit applies to --eval (the evaluation after the conversion)")
        check_method_options(args)


def check_method_options(args: argparse.Namespace) -> None:
    """An option of another method is refused, not ignored; each option class of the method checks its
    values (`check()`), before any model is looked at."""
    from attnkit import registry
    from attnkit.options import from_namespace, given

    method = registry.get(args.to)
    for cls in registry.option_classes():
        if cls in method.configs:
            settings = from_namespace(cls, args)
            if hasattr(settings, "check"):
                settings.check()
            continue
        for flag in given(cls, args):
            users = registry.users_of(cls)
            raise AttnkitError(f"{flag} applies to {' and '.join(f'--to {u}' for u in users)}, not --to {args.to}")


def _claim(args: argparse.Namespace):
    """`attnkit convert` holds OUT from the start (`claim_output`): a second run writing the same OUT is
    refused in one line before its work, not after it. The cheap checks of OUT come first, so a bad
    OUT (on the source, not empty) is refused without touching anything beside it."""
    if args.command != "convert":
        return contextlib.nullcontext()
    from attnkit.io.checkpoint import check_output_dir, claim_output
    from attnkit.io.resolve import ASSETS, BUNDLED

    local = ASSETS / args.model if args.model in BUNDLED else Path(args.model).expanduser()
    check_output_dir(args.out, args.force, (local,) if local.is_dir() else ())
    return claim_output(args.out)


def run(args: argparse.Namespace):
    """A parsed command, checked and run: what `main` does short of turning errors into exit statuses
    (the Python API calls it with the namespace it builds)."""
    check_arguments(args)
    with _claim(args):
        return load_handler(HANDLERS[args.command], f"attnkit {args.command}")(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except AttnkitError as exc:
        print(f"attnkit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnkit: interrupted; nothing was written", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
