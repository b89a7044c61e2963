"""The options of `attnkit eval` and `attnkit bench`: the command line is built from these classes and
`attnkit.evaluate` / `attnkit.bench` take them, so each default, help line and check is written once.

Kept free of torch and transformers: `attnkit --help` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnkit.errors import AttnkitError
from attnkit.options import option

DEVICE_HELP = "cpu or cuda (default: cuda when available)"
DTYPES = ("bf16", "fp16", "fp32")


def at_least(flag: str, value: int | None, low: int, what: str) -> None:
    """A number argparse takes as a plain int but the command cannot use: one line before any work."""
    if value is not None and value < low:
        raise AttnkitError(f"{flag} must be {what}, got {value}")


@dataclass
class EvalOptions:
    """How `attnkit eval` measures: which lm-eval tasks, how many documents, in which dtype."""

    tasks: str = option("attnkit-quick", "attnkit-quick (default: a subset of attnkit-ppl and attnkit-complete, and "
                        "attnkit-recall-256; seconds per small model on a CPU), attnkit-core (all bundled tasks, what "
                        "recipes run), or comma-separated lm-eval task names")
    limit: int | None = option(None, "at most N documents per task (quick checks)")
    batch_size: int = option(4, "lm-eval batch size")
    dtype: str = option("fp32", "evaluation dtype", choices=DTYPES)
    device: str | None = option(None, DEVICE_HELP)
    verbose: bool = option(False, "show lm-eval's own logs, warnings and progress bars")

    def check(self) -> None:
        at_least("--limit", self.limit, 1, "a positive number of documents per task (leave it out for all)")
        at_least("--batch-size", self.batch_size, 1, "at least 1")


@dataclass
class BenchOptions:
    """How `attnkit bench` measures: the grid of contexts and batches, the repeats, the attention path."""

    context: tuple[int, ...] = option((1024, 4096, 16384), "context lengths, comma-separated")
    batch: tuple[int, ...] = option((1,), "batch sizes, comma-separated")
    decode_tokens: int = option(32, "tokens generated per decode measurement")
    repeats: int = option(3, "repeated runs (median and spread reported)")
    attn: str = option("auto", "MLA attention path", choices=("absorbed", "expanded", "auto"))
    baseline_attn: str | None = option(None, "MLA attention path of --baseline (default: same as --attn)",
                                       choices=("absorbed", "expanded", "auto"))
    threads: int | None = option(None, "torch CPU threads (default: torch's choice)")
    clock: str = option("wall", "time with the wall clock, or process CPU time (steadier on a shared CPU; CUDA: "
                        "always wall)", choices=("wall", "cpu"))
    prefill_chunk: int = option(0, "prefill in chunks of N tokens through the cache (default 0: the whole prompt at "
                                "once)", metavar="N")
    dtype: str = option("fp32", "benchmark dtype", choices=DTYPES)
    device: str | None = option(None, DEVICE_HELP)

    def check(self) -> None:
        at_least("--threads", self.threads, 1, "at least 1 (leave it out for torch's choice)")
        at_least("--prefill-chunk", self.prefill_chunk, 0, "a number of tokens, or 0 for the whole prompt at once")
