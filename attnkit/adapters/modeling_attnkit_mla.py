"""The `attnkit` MLA format for QK-norm families (Qwen3, OLMo-2, Gemma-3; `convert --to mla --format attnkit`).

A QK-norm source normalises each token's keys before RoPE, so no linear latent of the hidden state
reproduces them. The norm depends on that token alone, though, so the latent can be written from the
*normalised* keys and the values instead:

    write:  k̂ = k_norm(W_k x), v = W_v x           per KV head, the source's own modules
            [c (r) | k_pe (d_r)] = kv_a_proj([k̂; v])   one linear map; RoPE on k_pe   → cache r + d_r
    query:  q̂ = q_norm(W_q x); [q_nope | q_pe]_h = q_map_h q̂_h                       per head
    read:   k_nope, v = kv_b_proj(c) per head; softmax((q_nope·k_nope + q_pe·k_pe) · scaling) v → o_proj

Everything after the cache is linear, so absorbed decoding (`attnkit.adapters.mla`: the same latent
cache and per-call rule as DeepSeek-V3 outputs) applies unchanged. There is no latent norm. The
shared RoPE key is rotated with the source's own cos/sin tables (any source scaling, per-layer
tables), at the source frequency pairs `config.attnkit["rope_pairs"]`.

The model is the source family's own model class with each attention module replaced, so its
decoder layers, MLPs and norms are the source's (Gemma-3's sandwich norms, scaled embeddings and
final-logit softcapping included). The softmax scale is the source attention's (Gemma-3's
`query_pre_attn_scalar`); each layer gets the RoPE tables and mask of its type from the source's model
(Gemma-3's local/global bases and sliding windows), and a sliding-window layer's latent cache keeps only
its window (`mla.SlidingLatentLayer`). This file (with mla.py and families.py) is copied
into converted checkpoints and referenced from `auto_map`; importing `attnkit.adapters` registers
the classes with the Auto classes.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from .families import FAMILIES as DESCRIPTIONS
from .mla import LatentDims, cached_latent, latent_output


def normed_qkv(attn: nn.Module, qk_norm: str, x: torch.Tensor, heads: int, kv_heads: int, d: int):
    """(q̂ [B, T, H·d], k̂ [B, T, G·d], v [B, T, G·d]): the source's projections and QK norms
    ("head": per head, Qwen3/Gemma-3; "all": over all heads at once, OLMo-2)."""
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    if qk_norm == "all":
        return attn.q_norm(q), attn.k_norm(k), v
    q = attn.q_norm(q.unflatten(-1, (heads, d))).flatten(-2)  # [B, T, H, d] normed per head
    k = attn.k_norm(k.unflatten(-1, (kv_heads, d))).flatten(-2)
    return q, k, v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def slot_tables(cos: torch.Tensor, sin: torch.Tensor, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The source's rotate-half tables [B, T, d] restricted to the kept frequency pairs: [B, T, d_r]."""
    c, s = cos[..., pairs], sin[..., pairs]
    return torch.cat([c, c], dim=-1), torch.cat([s, s], dim=-1)


class LatentQKNormAttention(nn.Module):
    """MLA whose latent is written from the source's normalised keys and values (module docstring)."""

    attnkit_mode = "auto"  # absorbed / expanded per call (attnkit.adapters.mla.use_absorbed)
    attnkit_latent = True

    def __init__(self, config, layer_idx: int):
        super().__init__()
        spec = config.attnkit
        desc = DESCRIPTIONS[spec["base_model_type"]]
        source = desc.attention_class()(config, layer_idx)  # q/k/v projections and norms, built as the source builds them
        self.config, self.layer_idx, self.qk_norm = config, layer_idx, desc.qk_norm
        self.q_proj, self.k_proj, self.v_proj = source.q_proj, source.k_proj, source.v_proj
        self.q_norm, self.k_norm = source.q_norm, source.k_norm
        self.scaling = source.scaling
        self.sliding_window = getattr(source, "sliding_window", None)
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, source.head_dim
        self.rope_pairs = list(spec["rope_pairs"])
        rank, d_r, d = spec["kv_lora_rank"], 2 * len(self.rope_pairs), self.head_dim
        self.latent_dims = LatentDims(self.heads, rank, d_r, d, d)
        self.q_map = nn.Parameter(torch.zeros(self.heads, d + d_r, d))  # per head q̂_h → [q_nope | q_pe]
        self.kv_a_proj = nn.Linear(2 * self.kv_heads * d, rank + d_r, bias=True)  # [k̂; v] → [c | k_pe]
        self.kv_b_proj = nn.Linear(rank, self.heads * 2 * d, bias=False)  # c → per head [k_nope | v]
        self.o_proj = nn.Linear(self.heads * d, config.hidden_size, bias=True)  # the value bias lives here
        self._pairs: dict[torch.device, torch.Tensor] = {}

    def _pair_index(self, device: torch.device) -> torch.Tensor:
        if device not in self._pairs:
            self._pairs[device] = torch.tensor(self.rope_pairs, dtype=torch.long, device=device)
        return self._pairs[device]

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        if "past_key_values" in kwargs and cache is None:
            cache = kwargs.pop("past_key_values")
        b, q_len = hidden_states.shape[:-1]
        H, d, rank, d_r = self.heads, self.head_dim, self.latent_dims.rank, self.latent_dims.rope
        q, k, v = normed_qkv(self, self.qk_norm, hidden_states, H, self.kv_heads, d)
        q = torch.einsum("bthd,hed->bhte", q.view(b, q_len, H, d), self.q_map.to(q.dtype))  # [B, H, Q, d + d_r]
        q_nope, q_rot = torch.split(q, [d, d_r], dim=-1)
        c_kv, k_rot = torch.split(self.kv_a_proj(torch.cat([k, v], dim=-1)), [rank, d_r], dim=-1)  # [B, Q, r], [B, Q, d_r]
        cos, sin = slot_tables(*position_embeddings, self._pair_index(hidden_states.device))  # [B, Q, d_r]
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
        q_rot = q_rot * cos + _rotate_half(q_rot) * sin
        k_rot = k_rot[:, None] * cos + _rotate_half(k_rot[:, None]) * sin  # [B, 1, Q, d_r]
        fused = cached_latent(cache, self.layer_idx, c_kv[:, None], k_rot)  # [B, S, r + d_r]
        out = latent_output(self, q_nope, q_rot, fused, attention_mask)  # [B, Q, H, d]
        return self.o_proj(out.reshape(b, q_len, -1)), None


def install_latent(model: nn.Module, config) -> None:
    """Replace every decoder layer's attention by the latent one (weights loaded afterwards)."""
    for layer in model.model.layers:
        layer.self_attn = LatentQKNormAttention(config, layer.self_attn.layer_idx)


def _make_classes(name: str) -> tuple[type, type]:
    desc = DESCRIPTIONS[name]
    base_config, base_model = desc.config_class(), desc.causal_lm_class()
    stem = f"AttnkitMla{desc.prefix}"
    config_class = type(f"{stem}Config", (base_config,), {"model_type": f"attnkit_mla_{name}", "__module__": __name__})

    def __init__(self, config):
        base_model.__init__(self, config)
        install_latent(self, config)

    model_class = type(f"{stem}ForCausalLM", (base_model,),
                       {"config_class": config_class, "__init__": __init__, "__module__": __name__})
    return config_class, model_class


CLASSES: dict[str, tuple[type, type]] = {}
for _name in [n for n, d in DESCRIPTIONS.items() if d.qk_norm]:
    CLASSES[_name] = _make_classes(_name)
    globals()[CLASSES[_name][0].__name__] = CLASSES[_name][0]
    globals()[CLASSES[_name][1].__name__] = CLASSES[_name][1]


def auto_map(name: str) -> dict[str, str]:
    """config.json's `auto_map` for a converted `name` model (this file shipped beside it)."""
    config_class, model_class = CLASSES[name]
    return {"AutoConfig": f"{__name__.rsplit('.', 1)[-1]}.{config_class.__name__}",
            "AutoModelForCausalLM": f"{__name__.rsplit('.', 1)[-1]}.{model_class.__name__}"}


def register() -> None:
    """Register the attnkit MLA config/model classes with the transformers Auto classes."""
    for config_class, model_class in CLASSES.values():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
