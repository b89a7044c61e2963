"""Which parameters a healing run trains: new ones (by name pattern), attention, everything, or LoRA.

`new` is the cheap default after a conversion: only what the converter created or changed
(e.g. MLA's `kv_a_proj_with_mqa`, `kv_b_proj`, `kv_a_layernorm`, `q_proj`; DEX/DIFF submodules)
learns, everything the source model had stays frozen. The recipe declares the name patterns.
"""

from __future__ import annotations

import re

import torch

from attnkit.errors import AttnkitError

ATTENTION_PATTERN = r"(^|\.)self_attn\."


def matching(names: list[str], patterns: list[str]) -> list[str]:
    """Names that match any regex (re.search); every pattern must match something."""
    try:
        compiled = [(p, re.compile(p)) for p in patterns]
    except re.error as exc:
        raise AttnkitError(f"recipe key train.patterns: invalid regex ({exc})") from None
    for pattern, rx in compiled:
        if not any(rx.search(n) for n in names):
            raise AttnkitError(f"recipe key train.patterns: {pattern!r} matches no parameter of the model")
    return [n for n in names if any(rx.search(n) for _, rx in compiled)]


def select_trainable(model: torch.nn.Module, mode: str, patterns: list[str]) -> list[str]:
    """Set requires_grad for `new` / `attention` / `full`; return the trainable names."""
    names = [n for n, _ in model.named_parameters()]
    if mode == "full":
        chosen = names
    elif mode == "attention":
        chosen = matching(names, [ATTENTION_PATTERN])
    elif mode == "new":
        chosen = matching(names, patterns)
    else:
        raise ValueError(f"select_trainable does not handle {mode!r}")
    keep = set(chosen)
    for name, param in model.named_parameters():
        param.requires_grad_(name in keep)
    return chosen


def apply_lora(model: torch.nn.Module, lora) -> torch.nn.Module:
    """Wrap in a PEFT LoRA model; `modules_to_save` (e.g. new norms) are trained in full."""
    from peft import LoraConfig, get_peft_model

    module_names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    for key, wanted in (("target_modules", lora.target_modules), ("modules_to_save", lora.modules_to_save)):
        missing = [m for m in wanted if m not in module_names]
        if missing:
            raise AttnkitError(f"recipe key train.lora.{key}: no module named {', '.join(missing)} in the model")
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        modules_to_save=list(lora.modules_to_save) or None,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def describe(model: torch.nn.Module) -> str:
    """'N of M parameters (p %)' — goes into finetune_report.json `trainable`."""
    total = sum(p.numel() for p in model.parameters())
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{train:,} of {total:,} parameters ({100 * train / max(1, total):.2f} %)"
