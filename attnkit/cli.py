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
    "finetune": "attnkit.recipes.finetune:main",
    "eval": "attnkit.evaluation.run:main",
    "bench": "attnkit.evaluation.bench:main",
    "push": "attnkit.io.hub:main",
    "pretrain": "attnkit.recipes.pretrain:main",
    "tasks": "attnkit.evaluation.tasks:main",
}

MODEL_HELP = "a Hub id (owner/name), a local folder, or `reference` / `reference-qwen3` for a bundled model"


def _int_list(text: str) -> list[int]:
    """"1024,4096" -> [1024, 4096]; at least one value, every one positive."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _add_convert(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="rewrite a checkpoint's attention (MLA, DEX, DIFF, fewer KV heads)",
        description="Rewrite the attention of MODEL and write a new checkpoint into OUT (atomically).",
        epilog="example:\n  attnkit convert --to mla reference -o out/ref-mla --kv-lora-rank 28 --rope-dim 48 --eval\n"
        "  attnkit convert --to dex reference -o out/ref-dex --heads auto\n"
        "  attnkit convert --to gqa reference -o out/ref-mqa --kv-heads 1",
    )
    p.add_argument("--to", required=True, choices=["mla", "dex", "diff", "mla+dex", "titans", "mla+titans", "gqa"], help="target attention")
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("-o", "--out", required=True, metavar="OUT", help="output folder (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="output dtype (default: source's)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the conversion math runs")
    p.add_argument(
        "--calib",
        default="python",
        metavar="SOURCE",
        help="calibration text: python (stdlib), python+site, a .txt/.jsonl file or folder, hf:NAME[:CONFIG][:SPLIT]",
    )
    p.add_argument("--calib-tokens", type=int, default=65536, metavar="N", help="calibration tokens (default 65536)")
    p.add_argument("--calib-seq-len", type=int, default=512, metavar="L", help="calibration sequence length")
    p.add_argument("--seed", type=int, default=0, help="seed for calibration sampling")
    p.add_argument("--eval", action="store_true", help="then evaluate OUT against MODEL in the same process, as "
                   "`attnkit eval OUT --baseline MODEL --tasks TASKS --out OUT/eval_results.json` would (the model "
                   "card states it)")
    p.add_argument("--tasks", default="attnkit-quick", metavar="TASKS", help="lm-eval tasks of --eval (as for attnkit eval)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="--eval: at most N documents per task (as for attnkit eval; quick checks)")
    mla = p.add_argument_group("MLA (--to mla)")
    mla.add_argument("--kv-lora-rank", type=int, default=None, metavar="R", help="latent rank r (default 512, clipped for small models)")
    mla.add_argument("--rope-dim", type=int, default=None, metavar="DR", help="decoupled RoPE dim d_r, even (default 64, clipped)")
    mla.add_argument("--rope-method", choices=["rorope", "partial"], default="rorope", help="how RoPE is reduced to d_r dims")
    mla.add_argument("--rope-score", choices=["energy", "loss"], default=None, help="how rorope's components are ranked "
                     "for the d_r RoPE slots: energy = key energy; loss = the score error NoPE'ing a component leaves "
                     "after the query refit (default: loss with exact frequencies, energy on a plain ladder)")
    mla.add_argument(
        "--target",
        choices=["engines", "transformers"],
        default="engines",
        help="engines: a DeepSeek-V3 checkpoint within what llama.cpp, vLLM and SGLang implement (no attention biases, "
        "interleaved RoPE, a plain RoPE ladder); transformers: exact at full size, runs in transformers only",
    )
    mla.add_argument(
        "--format",
        choices=["attnkit", "deepseek_v3"],
        default=None,
        help="deepseek_v3: a plain DeepSeek-V3 checkpoint (default for Llama/Qwen2/Mistral/Phi-3; for QK-norm families "
        "the norms are folded to constant scales: lossy, measured); attnkit: MLA with the source's QK norms applied "
        "before compression, exact, custom code (trust_remote_code; default for Qwen3)",
    )
    mla.add_argument(
        "--rope-frequencies",
        choices=["ladder", "exact", "geometric"],
        default=None,
        help="ladder (default with --target engines): every k-th source frequency, a plain theta ladder; exact (default "
        "with --target transformers): each kept component at its source frequency (longrope factors); geometric: plain "
        "ladder with folding",
    )
    mla.add_argument("--v-head-dim", type=int, default=None, metavar="N", help="value head size written, >= head_dim: zero-padded, exact, the cache unchanged (e.g. 128 for a head_dim-64 source, which vLLM's CUDA prefill kernels need); default head_dim")
    mla.add_argument("--objective", choices=["kv", "attention"], default="attention", help="latent PCA metric: kv = balanced K/V energy; attention = query-weighted keys, o_proj-weighted values")
    mla.add_argument("--eval-tokens", type=int, default=4096, metavar="N", help="held-out tokens for the per-step error report")
    mla.add_argument("--report", choices=["steps", "final"], default="steps", help="steps: run every conversion step end to end on the held-out text (the per-step table); final: only the written model (same tensors; with QK norms folded also the norm step), faster")
    mla.add_argument("--kv-budget", type=float, default=None, metavar="F", help="KV-cache bytes/token <= F x the source's: the (--kv-lora-rank, --rope-dim) split is chosen by measuring candidate conversions on held-out text")
    mla.add_argument("--engine-sizes", choices=["vllm", "vllm-cpu"], default=None, help="with --kv-budget: measure only the splits vLLM's MLA kernels take (rope dim 64, kv_lora_rank + rope dim 320/512/576; vllm-cpu: 576), the best one within the budget")
    mla.add_argument("--refit-query", action=argparse.BooleanOptionalAction, default=True, help="least-squares refit of the NoPE query to the source's RoPE'd scores (report stage 'refit'; default on, measured better)")
    mla.add_argument("--refit-weights", choices=["attention", "uniform"], default="attention", help="distances the refit averages RoPE over: the source's attention mass, or uniform over causal pairs")
    titans = p.add_argument_group("Titans (--to titans): window attention + neural long-term memory, Memory as Gate")
    titans.add_argument("--window", type=int, default=128, metavar="W", help="tokens the attention still sees (default 128)")
    titans.add_argument("--chunk", type=int, default=16, metavar="C", help="tokens the memory reads per update, <= W (default 16)")
    titans.add_argument("--memory-depth", type=int, default=2, metavar="N", help="layers of the memory MLP (default 2; 0 = the window alone, no memory: the baseline)")
    titans.add_argument("--memory-dim", type=int, default=None, metavar="M", help="memory key/value size per head (default: head_dim)")
    titans.add_argument("--variant", choices=["mag", "mal"], default="mag", help="how memory and attention combine: mag = Memory as Gate (mal, Memory as a Layer: not implemented, refused)")
    gqa = p.add_argument_group("GQA (--to gqa)")
    gqa.add_argument("--kv-heads", type=int, default=None, metavar="N", help="KV heads per layer of the output (divides the source's)")
    gqa.add_argument("--merge", choices=["aligned", "mean"], default="aligned", help="aligned: Procrustes-aligned heads, "
                     "similarity groups, weighted merge, o_proj refit; mean: contiguous groups, plain mean")
    dex = p.add_argument_group("DEX (--to dex)")
    dex.add_argument("--heads", default="auto", help="auto | all | FRACTION in (0, 1]: heads that get the differential op")
    dex.add_argument("--heads-fraction", type=float, default=0.5, help="fraction of heads per layer that `auto` selects")


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


def _add_measured_models(p: argparse.ArgumentParser, what: str, baseline_help: str) -> None:
    """MODEL, --baseline, --device, --dtype: what `eval` and `bench` both take."""
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--baseline", metavar="MODEL", default=None, help=baseline_help)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="fp32", help=f"{what} dtype")


def _add_eval(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="measure quality with lm-eval-harness (offline bundled tasks by default)",
        description="Evaluate MODEL (and --baseline) on lm-eval tasks; print a table, write JSON.",
        epilog="example:\n  attnkit eval out/ref-mla --baseline reference --tasks attnkit-core --out results.json",
    )
    _add_measured_models(p, "evaluation", "a second model; retention = model / baseline")
    p.add_argument(
        "--tasks",
        default="attnkit-quick",
        help="attnkit-quick (default: a subset of attnkit-ppl and attnkit-complete, and attnkit-recall-256; "
        "seconds per small model on a CPU), attnkit-core (all bundled tasks, what recipes run), "
        "or comma-separated lm-eval task names",
    )
    p.add_argument("--limit", type=int, default=None, help="at most N documents per task (quick checks)")
    p.add_argument("--batch-size", type=int, default=4, help="lm-eval batch size")
    p.add_argument("--out", default=None, metavar="FILE", help="write results JSON here")
    p.add_argument("--verbose", action="store_true", help="show lm-eval's own logs, warnings and progress bars")


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure prefill/decode speed, peak memory and KV-cache bytes",
        description="Benchmark MODEL (and --baseline) at several context lengths and batch sizes.",
        epilog="example:\n  attnkit bench out/ref-mla --baseline reference --context 1024,4096",
    )
    _add_measured_models(p, "benchmark", "a second model measured side by side")
    p.add_argument("--context", type=_int_list, default=[1024, 4096, 16384], help="context lengths, comma-separated")
    p.add_argument("--batch", type=_int_list, default=[1], help="batch sizes, comma-separated")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per decode measurement")
    p.add_argument("--repeats", type=int, default=3, help="repeated runs (median and spread reported)")
    p.add_argument("--attn", choices=["absorbed", "expanded", "auto"], default="auto", help="MLA attention path")
    p.add_argument("--baseline-attn", choices=["absorbed", "expanded", "auto"], default=None,
                   help="MLA attention path of --baseline (default: same as --attn)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="time with the wall clock, or process CPU time (steadier on a shared CPU; CUDA: always wall)")
    p.add_argument("--prefill-chunk", type=int, default=0, metavar="N",
                   help="prefill in chunks of N tokens through the cache (default 0: the whole prompt at once)")
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


def _at_least(args: argparse.Namespace, name: str, low: int, what: str) -> None:
    value = getattr(args, name, None)
    if value is not None and value < low:
        raise AttnkitError(f"--{name.replace('_', '-')} must be {what}, got {value}")


def check_arguments(args: argparse.Namespace) -> None:
    """Numbers argparse takes as plain ints but the commands cannot use: one line before any work."""
    if args.command == "eval":
        _at_least(args, "limit", 1, "a positive number of documents per task (leave it out for all)")
        _at_least(args, "batch_size", 1, "at least 1")
    elif args.command == "bench":
        _at_least(args, "threads", 1, "at least 1 (leave it out for torch's choice)")
        _at_least(args, "prefill_chunk", 0, "a number of tokens, or 0 for the whole prompt at once")
        if args.out:
            from attnkit.io.checkpoint import check_can_write

            check_can_write(args.out)  # now, not after the whole benchmark
    elif args.command == "convert":
        _at_least(args, "limit", 1, "a positive number of documents per task (leave it out for all)")
        if args.limit is not None and not args.eval:
            raise AttnkitError("--limit applies to --eval (the evaluation after the conversion)")
        for flag, value, default in (("--heads", args.heads, "auto"), ("--heads-fraction", args.heads_fraction, 0.5)):
            if value != default and args.to not in ("dex", "mla+dex"):
                raise AttnkitError(f"{flag} applies to --to dex and --to mla+dex, not --to {args.to}")


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_arguments(args)
        with _claim(args):
            result = load_handler(HANDLERS[args.command], f"attnkit {args.command}")(args)
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
