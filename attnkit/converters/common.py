"""What every conversion driver shares: dtype names, the device check, the source's identity in a
report, the source dtype, and the calibration / held-out split of the calibration text."""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch

from attnkit.converters.options import calib_seq_len
from attnkit.data import pack_tokens
from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import weights_fingerprint

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def check_device(name: str | None) -> torch.device:
    """`--device` as a torch device; one line when CUDA is asked for and absent."""
    if name == "cuda" and not torch.cuda.is_available():
        raise AttnkitError("--device cuda was given but no CUDA device is available")
    return torch.device(name or "cpu")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def source_info(path: Path, model_type: str | None, model: str | None = None) -> dict:
    """The report's `source` section: where the source came from and fingerprints of what it was."""
    info = {"path": str(path), "model_type": model_type, "sha256_config": _sha256((path / "config.json").read_bytes()),
            "sha256_weights_index": weights_fingerprint(path)}
    return info if model is None else {**info, "model": model}


@dataclass(kw_only=True)
class StreamSettings:
    """What every streamed conversion (`--to mla`, `--to gqa`) is calibrated, measured and written
    with; each method's settings add its own fields."""

    calib: str
    calib_tokens: int
    eval_tokens: int
    seq_len: int
    seed: int
    device: str
    dtype_name: str
    out_dtype: torch.dtype
    max_shard_bytes: int = 1 << 27
    PRIVATE: ClassVar[tuple[str, ...]] = ("out_dtype", "max_shard_bytes")  # left out of the report

    def public(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in self.PRIVATE}


def stream_fields(args: argparse.Namespace, src_dtype: torch.dtype) -> dict:
    """`StreamSettings`' fields from the command line (the output dtype defaults to the source's)."""
    seq_len = calib_seq_len(args)  # also for callers that do not go through `attnkit convert` (benchmarks' `prepare`)
    for name, value in (("calib_tokens", args.calib_tokens), ("calib_seq_len", seq_len)):
        if value <= 1:
            raise AttnkitError(f"--{name.replace('_', '-')} must be > 1")
    out_dtype = DTYPES[args.dtype] if args.dtype else src_dtype
    return dict(calib=args.calib, calib_tokens=args.calib_tokens, eval_tokens=getattr(args, "eval_tokens", None) or 4096,
                seq_len=seq_len, seed=args.seed, device=args.device,
                dtype_name=DTYPE_NAMES.get(out_dtype, "float32"), out_dtype=out_dtype)


CALIB_FORMS = "python, python+site, a .txt/.jsonl file or folder, or hf:NAME[:CONFIG][:SPLIT]"


def check_calib_source(source: str) -> None:
    """A `--calib` that names a file or folder that is not there is said as such, before any work."""
    if source in ("python", "python+site") or source.startswith("hf:"):
        return
    if not Path(source).expanduser().exists():
        raise AttnkitError(f"--calib {source}: no such file or folder (--calib takes {CALIB_FORMS})")


def calibration_tokens(tokenizer, source: str, seq_len: int, n_calib: int, n_eval: int, seed: int):
    """(calibration rows from the train split, held-out rows from the validation split, a note)."""
    text = calibration_text(tokenizer, source, seq_len, n_calib, n_eval, seed)
    return text.calib, text.held_out, text.note


@dataclass
class CalibrationText:
    calib: torch.Tensor  # [N, T] token rows of the train split
    held_out: torch.Tensor  # [M, T] of the validation split (or the last rows of the text: `note` says)
    note: str
    spare: torch.Tensor  # [K, T] validation rows after the held-out ones (K <= what was asked; may be 0)


def calibration_text(tokenizer, source: str, seq_len: int, n_calib: int, n_eval: int, seed: int,
                     n_spare: int = 0) -> CalibrationText:
    """Calibration rows, held-out rows and up to `n_spare` tokens of spare validation rows, the text read
    once here (`--kv-budget` chooses its split on the spare rows, so the report's held-out rows stay an
    unbiased check). A source with no validation documents (one file) gives its last rows as the held-out
    set, and no spare rows."""
    check_calib_source(source)
    try:
        calib = pack_tokens(tokenizer, source, "train", seq_len, n_calib + n_eval, seed)
    except AttnkitError as exc:
        raise AttnkitError(f"calibration source is empty or too short: {exc}") from None
    n_held = n_eval // seq_len
    try:  # one read of the validation split: the held-out rows, then the spare rows after them
        validation = pack_tokens(tokenizer, source, "validation", seq_len, n_eval + n_spare, seed)
    except AttnkitError:
        validation = calib[:0]
    held_out, spare = validation[:n_held], validation[n_held : n_held + n_spare // seq_len]
    if held_out.shape[0] == 0:
        if calib.shape[0] < 2:
            raise AttnkitError(
                f"calibration source {source!r} gives one sequence of {seq_len} tokens; need two (calibration + held-out)"
            ) from None
        n_held = max(1, min(n_held, calib.shape[0] // 2))
        note = "last rows of the calibration text (the source has no validation documents)"
        return CalibrationText(calib[:-n_held][: max(1, n_calib // seq_len)], calib[-n_held:], note, calib[:0])
    return CalibrationText(calib[: max(1, n_calib // seq_len)], held_out, "validation split", spare)
