"""The options every `attnkit convert --to …` takes. A method's own options are in its folder
(`converters/<method>/config.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from attnkit.options import option

CALIB_SEQ_LEN = 512  # calibration rows: long enough for RoPE's reach, short enough for [B, H, T, T] statistics
FIT_SEQ_LEN = 1024  # with the MLA layer fit: the rows the healing recipes train and `attnkit-ppl` scores on


def calib_seq_len(args) -> int:
    """--calib-seq-len, or its default. The layer fit (`--fit-steps`) learns what the written attention does
    over the rows it sees: fitted on 512-token rows a layer is fitted for 512 tokens of reach, and the
    heal and the evaluation then run at 1024 (reference-mha 243/64, 400 fit steps, healed within 2 %:
    attnkit-ppl x1.025 fitted at 512, x1.018 at 1024; docs/mla.md). The fit's cost doubles with it."""
    if getattr(args, "calib_seq_len", None) is not None:
        return args.calib_seq_len
    return FIT_SEQ_LEN if getattr(args, "fit_steps", 0) else CALIB_SEQ_LEN


@dataclass
class ConvertOptions:
    """What every method reads: calibration text, output dtype, device, and the evaluation after it."""

    GROUP: ClassVar[str | None] = None  # the command's own options, not a group
    force: bool = option(False, "replace a non-empty OUT")
    dtype: str | None = option(None, "output dtype (default: source's)", choices=("bf16", "fp16", "fp32"))
    device: str = option("cpu", "where the conversion math runs", choices=("cpu", "cuda"))
    calib: str = option("python", "calibration text: python (stdlib), python+site, a .txt/.jsonl file or folder, "
                        "hf:NAME[:CONFIG][:SPLIT]", metavar="SOURCE")
    calib_tokens: int = option(65536, "calibration tokens (default 65536)", metavar="N")
    calib_seq_len: int | None = option(
        None, f"calibration sequence length; with --fit-steps (--to mla) {FIT_SEQ_LEN}, the healing recipes' rows "
        f"(default: {CALIB_SEQ_LEN})", metavar="L")
    calib_dtype: str = option("auto", "what the source's MLP multiplies the calibration and held-out rows in: auto = "
                              "a bf16/fp16 checkpoint's own dtype where --device does it natively (AMX or AVX512-BF16 "
                              "CPUs, CUDA), else fp32; fp32 = always fp32 (what the whole model loaded in fp32 computes)",
                              choices=("auto", "fp32"))
    seed: int = option(0, "seed for calibration sampling")
    eval: bool = option(False, "then evaluate OUT against MODEL in the same process, as `attnkit eval OUT --baseline "
                        "MODEL --tasks TASKS --out OUT/eval_results.json` would (the model card states it)")
    tasks: str = option("attnkit-quick", "lm-eval tasks of --eval (as for attnkit eval)", metavar="TASKS")
    limit: int | None = option(None, "--eval: at most N documents per task (as for attnkit eval; quick checks)",
                               metavar="N")
    eval_tokens: int | None = option(None, "held-out tokens for the error report (default: 4096 for mla and gqa, 4 "
                                     "rows of --calib-seq-len for dex, diff and titans)", metavar="N")
