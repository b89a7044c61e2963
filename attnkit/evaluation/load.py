"""Loading the models `attnkit eval` scores: every MODEL spec checked before any model loads, then each
model as `from_pretrained` gives it (remote code included), every way a folder can be wrong one line."""

from __future__ import annotations

import torch

from attnkit.errors import AttnkitError
from attnkit.io.resolve import check_causal_lm, resolve_model
from attnkit.sdpa import implementation_for

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_model(spec: str, dtype: str = "fp32", device: str | None = None):
    """MODEL spec → (model, tokenizer, path), with one-line errors for every way a folder can be wrong."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(spec)
    config = check_causal_lm(path)
    remote = "auto_map" in config
    if remote:
        import attnkit.adapters  # noqa: F401  (registers attnkit's DEX/DIFF classes)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=remote)
    except Exception as exc:
        raise AttnkitError(f"cannot load the tokenizer of {spec}: {first_line(exc)}") from None
    try:
        fused = implementation_for(config)  # MLA's q/k vs v head sizes: SDPA's fused kernels, V zero-padded
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], trust_remote_code=remote,
                                                     **({"attn_implementation": fused} if fused else {}))
    except Exception as exc:
        raise AttnkitError(f"cannot load {spec} as a causal LM: {first_line(exc)}") from None
    model.to(_device(device)).eval()
    return model, tokenizer, path


def first_line(exc: BaseException) -> str:
    """An exception as one short line: what a one-line AttnkitError quotes of a library's error."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def _device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise AttnkitError("--device cuda was given but no CUDA device is available")
    return torch.device(device)


def check_inputs(specs: list[str]) -> None:
    """Resolve and check every MODEL spec before any model is loaded or evaluated (one-line errors);
    weights whose shapes contradict the config are named here, not in transformers' load report, and so
    is a NaN/Inf weight (its perplexity would be nan beside accuracies that look normal)."""
    from attnkit.converters.shapes import check_weights
    from attnkit.io.checkpoint import check_finite

    paths = []
    for spec in specs:
        path = resolve_model(spec)
        config = check_causal_lm(path)
        check_weights(path, config, required=False, where=f"cannot load {spec}")
        paths.append(path)
    for spec, path in zip(specs, paths):  # reads every weight: after the header-only checks of all of them
        check_finite(path, spec)
