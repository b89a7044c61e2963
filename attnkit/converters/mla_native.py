"""MLA parameters -> a dense DeepSeek-V3 checkpoint (config + tensor names), SPEC §3 steps 5-6.

`kv_a_layernorm` (RMSNorm over the latent, always applied) is made a near-constant scale by a
reserved latent channel carrying a large constant `c` through the `kv_a_proj_with_mqa` bias:
rms ~ c / sqrt(m + 1), the norm weight undoes it, and `kv_b_proj`'s column for that channel
carries the K/V biases. A query bias (Qwen2) has no slot in `q_proj`; then `q_lora_rank = D + 1`
with `q_a_proj = [I; 0]` and the same constant trick on `q_a_layernorm`.
"""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config

from attnkit.converters.mla import MLAParams, Shape

# c / max|latent| on calibration data: the norm's relative error is about (max|z| / c)^2 / 2
CONST_MARGIN = 1e4


def deepseek_config(src: dict, shape: Shape, d_r: int, kv_lora_rank: int, q_lora_rank: int | None,
                    rope_parameters: dict, dtype: str) -> DeepseekV3Config:
    """A dense DeepSeek-V3 config: no MoE layer is built (first_k_dense_replace = num layers)."""
    n_layers = src["num_hidden_layers"]
    return DeepseekV3Config(
        vocab_size=src["vocab_size"],
        hidden_size=shape.D,
        intermediate_size=src["intermediate_size"],
        moe_intermediate_size=src["intermediate_size"],
        num_hidden_layers=n_layers,
        num_attention_heads=shape.H,
        num_key_value_heads=shape.H,
        n_shared_experts=1,
        n_routed_experts=1,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=1,
        first_k_dense_replace=n_layers,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=d_r,
        qk_nope_head_dim=shape.d,
        v_head_dim=shape.d,
        hidden_act=src.get("hidden_act", "silu"),
        max_position_embeddings=src.get("max_position_embeddings", 4096),
        rms_norm_eps=src.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(src.get("tie_word_embeddings", False)),
        rope_parameters=rope_parameters,
        rope_interleave=False,
        attention_bias=True,
        attention_dropout=0.0,
        num_nextn_predict_layers=0,
        bos_token_id=src.get("bos_token_id"),
        eos_token_id=src.get("eos_token_id"),
        pad_token_id=src.get("pad_token_id"),
        initializer_range=src.get("initializer_range", 0.02),
        architectures=["DeepseekV3ForCausalLM"],
        dtype=dtype,
    )


def constant_for(max_norm: float, dtype: torch.dtype) -> float:
    """The reserved channel's constant, representable in `dtype` (fp16 caps it)."""
    c = max(1.0, CONST_MARGIN * float(max_norm))
    if dtype == torch.float16:
        c = min(c, 3.0e4)
    return float(torch.tensor(c, dtype=dtype).float())  # the value the stored bias really has


def _norm_weight(c: float, channels: int) -> float:
    # RMS of a latent that is all zeros but the constant channel (DeepSeek's eps is 1e-6)
    return (c * c / channels + 1e-6) ** 0.5


def native_attention_tensors(p: MLAParams, shape: Shape, c_kv: float, c_q: float | None) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 `self_attn.*` tensors (fp64) for one layer."""
    H, d, D = shape.H, shape.d, shape.D
    m, d_r = p.lat_w.shape[0], p.pe_w.shape[0]
    t: dict[str, torch.Tensor] = {}
    q_w = p.q_w.reshape(H * (d + d_r), D)
    if p.q_b is None:
        t["q_proj.weight"] = q_w
    else:
        t["q_a_proj.weight"] = torch.cat([torch.eye(D, dtype=torch.float64), torch.zeros(1, D, dtype=torch.float64)])
        t["q_a_proj.bias"] = torch.cat([torch.zeros(D, dtype=torch.float64), torch.tensor([c_q], dtype=torch.float64)])
        t["q_a_layernorm.weight"] = torch.full((D + 1,), _norm_weight(c_q, D + 1), dtype=torch.float64)
        t["q_b_proj.weight"] = torch.cat([q_w, p.q_b.reshape(-1, 1) / c_q], dim=1)
    zero_row = torch.zeros(1, D, dtype=torch.float64)
    t["kv_a_proj_with_mqa.weight"] = torch.cat([p.lat_w, zero_row, p.pe_w])  # [m + 1 + d_r, D]
    lat_b = torch.zeros(m, dtype=torch.float64) if p.lat_b is None else p.lat_b
    pe_b = torch.zeros(d_r, dtype=torch.float64) if p.pe_b is None else p.pe_b
    t["kv_a_proj_with_mqa.bias"] = torch.cat([lat_b, torch.tensor([c_kv], dtype=torch.float64), pe_b])
    t["kv_a_layernorm.weight"] = torch.full((m + 1,), _norm_weight(c_kv, m + 1), dtype=torch.float64)
    kvb_b = torch.zeros(H, 2 * d, dtype=torch.float64) if p.kvb_b is None else p.kvb_b
    kv_b = torch.cat([p.kvb_w, kvb_b[..., None] / c_kv], dim=2)  # [H, 2d, m + 1]
    t["kv_b_proj.weight"] = kv_b.reshape(H * 2 * d, m + 1)
    t["o_proj.weight"] = p.o_w
    t["o_proj.bias"] = torch.zeros(D, dtype=torch.float64) if p.o_b is None else p.o_b
    return t
