"""Reading the models a healing run needs: the student named by a recipe, its tokenizer, a causal LM in a
given dtype. Every failure is one line naming the model (`AttnkitError`), not a traceback from transformers."""

from __future__ import annotations

from pathlib import Path

import torch

from attnkit.errors import AttnkitError
from attnkit.io.resolve import resolve_model
from attnkit.sdpa import fused_kwargs


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise AttnkitError(f"cannot load the tokenizer of {path}: {str(exc).splitlines()[0]}") from None


def load_causal_lm(path: Path, trust_remote_code: bool, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                    **fused_kwargs(path))  # MLA: SDPA's fused kernels (V padded)
    except Exception as exc:
        raise AttnkitError(f"cannot load {path} as a causal LM: {str(exc).splitlines()[0]}") from None


def _making_command(spec: str, config_path: str | None) -> str | None:
    """The `attnkit convert ... -o SPEC` command a recipe's comment gives for its (local) model, if any."""
    if not config_path:
        return None
    try:
        lines = Path(config_path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        text = line.strip().lstrip("#").strip()
        words = text.split()
        if text.startswith("attnkit convert") and any(a in ("-o", "--out") and b.rstrip("/") == spec.rstrip("/")
                                                       for a, b in zip(words, words[1:])):
            return text
    return None


def resolve_student(spec: str, config_path: str | None = None) -> Path:
    """`resolve_model` for the recipe's `model`, where a local folder that is not there yet is said as such:
    `out/ref-mla30` is also a well-formed Hub id, and the Hub's "not in the cache / not found" would
    mislead. The command that makes it is named when the recipe's comment gives one."""
    if not Path(spec).expanduser().exists():
        command = _making_command(spec, config_path)
        if command:
            raise AttnkitError(f"model {spec}: the local folder does not exist; convert it first: {command}")
    try:
        return resolve_model(spec)
    except AttnkitError as exc:
        first = Path(spec).parts[0] if Path(spec).parts else ""
        if "/" in spec and not Path(spec).exists() and first and Path(first).is_dir():
            raise AttnkitError(f"model {spec}: the local folder does not exist (nor a Hub model of that name: "
                               f"{exc}); convert it first with `attnkit convert ... -o {spec}`") from None
        raise
