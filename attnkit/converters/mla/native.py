"""MLA parameters -> a dense DeepSeek-V3 checkpoint (config + tensor names): docs/mla.md, step 6 `native`.

`kv_a_layernorm` (RMSNorm over the latent, always applied) is made a near-constant scale by a
reserved latent channel carrying a large constant `c` through the `kv_a_proj_with_mqa` bias:
rms ~ c / sqrt(m + 1), the norm weight undoes it, and `kv_b_proj`'s column for that channel
carries the K/V biases. A query bias (Qwen2) has no slot in `q_proj`; then `q_lora_rank = D + 1`
with `q_a_proj = [I; 0]` and the same constant trick on `q_a_layernorm`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from attnkit.sdpa import register as register_sdpa
from attnkit.converters.mla.engines import TRANSFORMERS_ONLY_ARCHITECTURE, ladder_theta
from attnkit.converters.mla.layer import MLAParams, Shape
from attnkit.converters.mla.qknorm import attnkit_config, attnkit_module
from attnkit.converters.mla.rope import (exact_rope_parameters, geometric_rope_parameters, served_rope_parameters,
                                        target_rope)
from attnkit.converters.mla.settings import Settings
from attnkit.converters.mla.source import Source, has_q_bias, layer_rope, source_scale
from attnkit.errors import AttnkitError

# c / max|latent| on calibration data: the norm's relative error is about (max|z| / c)^2 / 2
CONST_MARGIN = 1e4


def deepseek_config(src: dict, shape: Shape, d_r: int, kv_lora_rank: int, q_lora_rank: int | None,
                    rope_parameters: dict, dtype: str, engine: bool = False, v_head_dim: int | None = None) -> DeepseekV3Config:
    """A dense DeepSeek-V3 config: no MoE layer is built (first_k_dense_replace = num layers).

    `engine`: the engine export's form (no biases, interleaved RoPE, q latent of rank D, an untied
    head, and two routed experts that no layer builds: llama.cpp asserts n_expert_groups < n_expert
    when an expert count is given, src/llama-model.cpp)."""
    n_layers = src["num_hidden_layers"]
    fields = {} if not engine else dict(q_lora_rank=shape.D, tie_word_embeddings=False, rope_interleave=True,
                                        attention_bias=False, n_routed_experts=2)
    return DeepseekV3Config(**{**dict(
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
        v_head_dim=v_head_dim or shape.d,
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
        # the transformers-only form under a name engines do not know: they refuse it instead of computing it wrong
        architectures=["DeepseekV3ForCausalLM" if engine else TRANSFORMERS_ONLY_ARCHITECTURE],
        dtype=dtype,
    ), **fields})


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


# ---------------------------------------------------------------- the target of one conversion


@dataclass
class Target:
    """The exported config of a conversion and what it implies: the RoPE frequencies transformers
    computes for it, their attention factor, and the softmax scale."""

    config: DeepseekV3Config
    inv_freq: torch.Tensor  # [d_r/2]
    attention_scaling: float
    scale: float


def target_for(src: Source, s: Settings, rope_dim: int, counts: torch.Tensor | None, kv_lora_rank: int,
               stride: int = 1) -> Target:
    """The DeepSeek-V3 target of a conversion with this split (`counts`: RoPE slots per source
    frequency, exact frequencies; `stride`: of the kept pairs, ladder frequencies)."""
    shape = src.shape
    src_inv, src_att = layer_rope(src, 0)  # (RoPE per layer type: the converter sets each layer's own)
    if s.format == "attnkit":  # k_pe rotated with the source's own tables at the kept pairs; the source's scale
        pairs = torch.arange(shape.d // 2).repeat_interleave(counts)
        config = attnkit_config(src.hf_config, src.family, kv_lora_rank, pairs.tolist())
        return Target(config, src_inv[pairs], src_att, source_scale(src))
    src_rope = dict(src.hf_config.rope_parameters or {})
    theta = float(src_rope.get("rope_theta", 10000.0))
    max_pos = int(src.config.get("max_position_embeddings", 4096))
    if s.rope_frequencies == "exact":
        slot_inv = src_inv[torch.arange(shape.d // 2).repeat_interleave(counts)]
        rope_params = exact_rope_parameters(slot_inv, theta, max_pos, src_att)
    elif s.rope_frequencies == "ladder":
        rope_params = served_rope_parameters({"rope_theta": ladder_theta(theta, stride, shape.d, rope_dim)}, max_pos)
    else:
        rope_params = served_rope_parameters(geometric_rope_parameters(src_rope), max_pos)
    engine = s.target == "engines"
    q_lora = shape.D + 1 if has_q_bias(src) and not engine else None
    cfg = deepseek_config(src.config, shape, rope_dim, kv_lora_rank, q_lora, rope_params, s.dtype_name, engine, s.v_head_dim)
    cfg._attn_implementation = register_sdpa()  # the fused kernels despite qk != v head sizes (measurement only)
    inv, att = target_rope(cfg)
    if s.rope_frequencies == "exact" and not torch.allclose(inv, slot_inv, rtol=1e-5):
        raise AttnkitError("internal: the exported RoPE frequencies differ from the kept ones")  # guarded by tests
    with torch.device("meta"):
        scale = DeepseekV3Attention(cfg, 0).scaling
    return Target(cfg, inv, att, scale)


def written_attention(config, layer: int, tensors: dict[str, torch.Tensor], dev: str, fmt: str) -> torch.nn.Module:
    """The written attention layer as its format runs it (fp32 on `dev`): what the `native` step measures."""
    if fmt == "attnkit":
        return attnkit_module(config, layer, tensors, dev)
    with torch.device("meta"):
        native = DeepseekV3Attention(config, layer)
    native.load_state_dict({n: v.float().to(dev) for n, v in tensors.items()}, strict=True, assign=True)
    return native
