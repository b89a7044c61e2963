"""Scaled dot-product attention whose query/key head size differs from the value's (MLA's).

PyTorch's fused attention kernels (flash attention on CPU and CUDA) take one head size for q, k and
v. MLA's queries and keys carry the RoPE part (qk = nope + rope dims) while its values do not, so
`scaled_dot_product_attention` falls back to its unfused path, which materialises the [T, T] scores:
3-4x slower on CPU at 1K tokens (112/64 dims: 119 ms vs 36 ms per 8-head call, one thread). Zero
columns change nothing: padding V with zeros adds zero output columns, which are dropped; padding q
and k with zeros leaves every score as it was (the scale is then given explicitly).

`attention_forward` is the same thing as a transformers attention function, registered as
`ATTENTION` so a DeepSeek-V3 model can be loaded with `attn_implementation=ATTENTION`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

ATTENTION = "attnkit_sdpa"


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, **kw) -> torch.Tensor:
    """`F.scaled_dot_product_attention` on [B, H, T, *] tensors of any q/k vs v head sizes, fused."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if dqk > dv:
        return F.scaled_dot_product_attention(q, k, F.pad(v, (0, dqk - dv)), scale=scale, **kw)[..., :dv]
    if dqk < dv:
        scale = dqk**-0.5 if scale is None else scale  # the default would follow the padded size
        q, k = F.pad(q, (0, dv - dqk)), F.pad(k, (0, dv - dqk))
    return F.scaled_dot_product_attention(q, k, v, scale=scale, **kw)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' own SDPA attention function with V zero-padded to the query's head size."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dqk, dv = query.shape[-1], value.shape[-1]
    if dqk <= dv:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out, weights = sdpa_attention_forward(module, query, key, F.pad(value, (0, dqk - dv)), attention_mask, **kwargs)
    return out[..., :dv], weights  # [B, T, H, dv]


def register() -> str:
    """Make `ATTENTION` a transformers attention implementation (masks as for "sdpa"); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION, attention_forward)
    AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return ATTENTION


def implementation_for(config: dict) -> str | None:
    """`ATTENTION` (registered) for a checkpoint config whose attention has different q/k and v head
    sizes (DeepSeek-V2/V3 MLA), else None: transformers' own default then applies."""
    qk = int(config.get("qk_nope_head_dim") or 0) + int(config.get("qk_rope_head_dim") or 0)
    v = config.get("v_head_dim")
    if config.get("model_type") in ("deepseek_v2", "deepseek_v3") and v and qk != int(v):
        return register()
    return None


def fused_kwargs(folder: Path) -> dict:
    """`from_pretrained` keyword arguments for a local checkpoint: its attention implementation when
    `implementation_for` names one (nothing otherwise, nor for an unreadable config)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    name = implementation_for(config) if isinstance(config, dict) else None
    return {"attn_implementation": name} if name else {}
