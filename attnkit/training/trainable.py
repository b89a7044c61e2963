"""Which parameters a healing run trains: new ones (by name pattern), attention, everything, or LoRA.

`new` is the cheap default after a conversion: only what the converter created or changed
(e.g. MLA's `kv_a_proj_with_mqa`, `kv_b_proj`, `kv_a_layernorm`, `q_proj`; DEX/DIFF submodules)
learns, everything the source model had stays frozen. The recipe declares the name patterns.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import LazyCheckpoint

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


def param_groups(model: torch.nn.Module, chosen: list[str], lr: float, rest_lr: float) -> list[dict]:
    """AdamW's groups: the chosen parameters at `lr`; with `rest_lr` > 0 every other one too, at `rest_lr`
    (the rest of the network adapts a little to the new attention while the new parameters move fast).

    Shared (tied) parameters are listed once, under their first name, as `model.parameters()` does."""
    keep = set(chosen)
    chosen_params, rest = [], []
    for name, param in model.named_parameters():
        if name in keep:
            chosen_params.append(param)
        elif rest_lr > 0:
            param.requires_grad_(True)
            rest.append(param)
    groups = [{"params": chosen_params, "lr": lr}]
    if rest:
        groups.append({"params": rest, "lr": rest_lr})
    return groups


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


def constant_latent_channels(attn: torch.nn.Module, read: Callable[[str], torch.Tensor] | None = None) -> list[int]:
    """MLA latent channels that carry a constant (zero weight row, non-zero bias in kv_a_proj_with_mqa).
    `read(attr)`: that projection's "weight"/"bias" from elsewhere (the checkpoint, for a model on the meta device).

    `attnkit convert --to mla` reserves such a channel so that `kv_a_layernorm` acts as a fixed
    scale (docs/mla.md, step 6 `native`); its activation is ~10⁵× the others.
    """
    proj, up = getattr(attn, "kv_a_proj_with_mqa", None), getattr(attn, "kv_b_proj", None)
    if proj is None or up is None:
        return []
    proj = getattr(proj, "base_layer", proj)  # PEFT-wrapped or plain Linear
    if getattr(proj, "bias", None) is None:
        return []
    rank = getattr(up, "base_layer", up).in_features
    weight, bias = (read("weight"), read("bias")) if read else (proj.weight.detach(), proj.bias.detach())
    weight, bias = weight[:rank], bias[:rank]  # [r, D], [r]: the latent rows (the RoPE key's rows follow)
    return [c for c in range(rank) if bool(weight[c].eq(0).all()) and float(bias[c]) != 0.0]


def constant_channel_map(model: torch.nn.Module, ckpt: LazyCheckpoint | None = None) -> dict[str, list[int]]:
    """{attention module name: its constant latent channels} (`constant_latent_channels`), modules with some;
    the weights read from `ckpt` one tensor at a time when given (the model may be on the meta device)."""
    found = {}
    for name, module in model.named_modules():
        prefix = f"{canonical_name(name)}.kv_a_proj_with_mqa."
        read = None if ckpt is None else (lambda attr, prefix=prefix: ckpt.get(prefix + attr, dtype=torch.float32))
        found[name] = constant_latent_channels(module, read)
    return {name: channels for name, channels in found.items() if channels}


def protect_constant_channels(model: torch.nn.Module, channels: dict[str, list[int]] | None = None) -> int:
    """Zero the gradients that touch a constant latent channel; returns how many channels were protected.
    `channels`: `constant_channel_map` as read elsewhere (a process whose weights are not loaded yet).

    Adam moves every weight by ~lr whatever its gradient's scale, so a kv_b_proj column that reads
    a 10⁵-sized constant would shift every key/value by lr·10⁵ in one step and wreck the model.
    With zero gradients Adam's moments stay zero and those entries never move.
    """
    channels = constant_channel_map(model) if channels is None else channels
    modules = dict(model.named_modules())
    for name, constant in channels.items():
        module, idx = modules[name], torch.tensor(constant)
        proj, up, norm = module.kv_a_proj_with_mqa, module.kv_b_proj, getattr(module, "kv_a_layernorm", None)
        _mask(getattr(proj, "base_layer", proj).weight, rows=idx)
        _mask(getattr(proj, "base_layer", proj).bias, rows=idx)
        _mask(getattr(up, "base_layer", up).weight, cols=idx)
        for lora_a in _adapters(up, "lora_A"):  # LoRA's down-projection must not read the constant
            with torch.no_grad():
                lora_a.weight[:, idx] = 0.0
            _mask(lora_a.weight, cols=idx)
        for lora_b in _adapters(proj, "lora_B"):
            _mask(lora_b.weight, rows=idx)  # and LoRA on kv_a_proj_with_mqa would write into it
        if norm is not None:
            _mask(norm.weight, rows=idx)
    return sum(len(c) for c in channels.values())


def _adapters(layer: torch.nn.Module, kind: str) -> list[torch.nn.Module]:
    adapters = getattr(layer, kind, None)
    return list(adapters.values()) if isinstance(adapters, torch.nn.ModuleDict) else []


def _mask(param: torch.nn.Parameter, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> None:
    if not param.requires_grad:
        return
    # a parameter on the meta device (an FSDP process that has not read its weights yet) gets a real mask
    keep = torch.ones(param.shape, dtype=torch.bool, device="cpu" if param.is_meta else param.device)
    if rows is not None:
        keep[rows] = False
    if cols is not None:
        keep[:, cols] = False
    if hasattr(param, "_attnkit_grad_keep"):  # a parameter masked twice keeps both masks
        keep &= param._attnkit_grad_keep
    param._attnkit_grad_keep = keep  # for FSDP, whose sharded parameters replace this one (grad_masks)
    param.register_hook(lambda grad, keep=keep: grad * keep.to(grad.device))


def grad_masks(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name: keep mask} of protect_constant_channels, read before FSDP replaces the parameters."""
    return {n: p._attnkit_grad_keep for n, p in model.named_parameters() if hasattr(p, "_attnkit_grad_keep")}


def canonical_name(name: str) -> str:
    """A parameter's name without what activation checkpointing and torch.compile wrap it in."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def sharded_grad_masks(model: torch.nn.Module, masks: dict[str, torch.Tensor]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """The masks laid out like FSDP2's sharded parameters (DTensors, each process its own rows).

    A tensor hook on a sharded parameter never fires (the forward runs on the gathered copy), so under
    FSDP the trainer multiplies the reduced, sharded gradients by these before clipping instead: the
    same zeros DDP's hooks give. A collective call (distribute_tensor): every process, same order.
    """
    if not masks:
        return []
    from torch.distributed.tensor import DTensor, distribute_tensor

    out, found = [], set()
    for name, param in model.named_parameters():
        canonical = canonical_name(name)
        if canonical not in masks:
            continue
        found.add(canonical)
        keep = masks[canonical].to(param.dtype)
        if isinstance(param, DTensor):
            keep = distribute_tensor(keep.to(param.device), param.device_mesh, param.placements)
        out.append((param, keep))
    missing = sorted(set(masks) - found)
    if missing:
        raise AttnkitError(f"constant latent channels: {missing[0]} not found after sharding; cannot protect it")
    return out
