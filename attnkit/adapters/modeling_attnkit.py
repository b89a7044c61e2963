"""Models converted by `attnkit convert --to dex|diff|titans`: the source architecture plus DEX/DIFF/Titans modules.

Each supported family is described once in `families.py` (shared with the converters); `FAMILIES`
here adds how its attention turns hidden states into per-head Q, K, V. The retrofitted attention forward is
the family's own computation up to the attention function, then:

    out = attention(Q, K, V)                        # [B, T, H, d_v], the source's kernel (sdpa/eager/…)
    DIFF: out = diff(out, attention(Q2, K, V))      # second map from a new query, same cached K
    DEX:  out = dex(out)                            # O − λ·f_D(O) on selected heads
    Titans: attention over the last W keys (and S slots: the most surprising keys it lost), then the memory
            mixed in by a gate: out = titans.blend(hidden, out, memory reads)
    return o_proj(out.reshape(B, T, H·d_v))

Q, K, V, the cache and o_proj are the source's, so the KV cache is unchanged and LoRA on the
source projections merges as usual. New modules: `self_attn.dex`, `self_attn.diff`,
`self_attn.diff_q_proj` (targets for PEFT `modules_to_save`).

The config keeps every source field and adds `attnkit = {"method", "base_model_type",
"selected_heads": [[h...] per layer] (DEX), "anneal_fraction"}`; `model_type` becomes
`attnkit_<family>` so that loading without this code fails loudly instead of silently dropping
the new weights. This file (with dex.py, diff.py and families.py) is copied into converted checkpoints
and referenced from `auto_map`, so it imports only torch and transformers.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as _deepseek
from transformers.models.llama import modeling_llama as _llama

from .dex import DexHeadMix
from .diff import DiffCombine
from .families import FAMILIES as DESCRIPTIONS
from .families import Family as Description
from .titans import TitansMemory, titans_attention, titans_cache_layer, with_titans_cache


# ---------------------------------------------------------------- per-family Q / K / V


def _llama_queries(rope: Callable) -> Callable:
    def queries(attn, proj: nn.Module, hidden: torch.Tensor, position_embeddings) -> torch.Tensor:
        # hidden [B, T, D] -> q [B, H, T, d] with RoPE
        q = proj(hidden).view(*hidden.shape[:-1], -1, attn.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        return rope(q, q, cos, sin)[0]

    return queries


def _llama_keys_values(rope: Callable) -> Callable:
    def keys_values(attn, hidden, position_embeddings, cache, kwargs):
        shape = (*hidden.shape[:-1], -1, attn.head_dim)
        k = attn.k_proj(hidden).view(shape).transpose(1, 2)  # [B, G, T, d]
        v = attn.v_proj(hidden).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        k = rope(k, k, cos, sin)[1]
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
        return k, v

    return keys_values


def _deepseek_queries(attn, proj: nn.Module | None, hidden, position_embeddings) -> torch.Tensor:
    # hidden [B, T, D] -> q [B, H, T, nope + rope]; the source query path when proj is None
    bsz, seq = hidden.shape[:-1]
    if proj is not None:
        q = proj(hidden)
    elif attn.q_lora_rank is None:
        q = attn.q_proj(hidden)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden)))
    q = q.view(bsz, seq, -1, attn.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    cos, sin = position_embeddings
    rope = _deepseek.apply_rotary_pos_emb_interleave if attn.config.rope_interleave else _deepseek.apply_rotary_pos_emb
    q_rot = rope(q_rot, q_rot, cos, sin)[0]
    return torch.cat((q_pass, q_rot), dim=-1)


def _deepseek_keys_values(attn, hidden, position_embeddings, cache, kwargs):
    bsz, seq = hidden.shape[:-1]
    kv_nope, k_rot = torch.split(attn.kv_a_proj_with_mqa(hidden), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    # the latent and the shared RoPE key, viewed as one head: [B, 1, T, r] and [B, 1, T, d_r]
    kv_nope = attn.kv_a_layernorm(kv_nope).view(bsz, 1, seq, attn.kv_lora_rank)
    k_rot = k_rot.view(bsz, 1, seq, attn.qk_rope_head_dim)
    cos, sin = position_embeddings
    rope = _deepseek.apply_rotary_pos_emb_interleave if attn.config.rope_interleave else _deepseek.apply_rotary_pos_emb
    k_rot = rope(k_rot, k_rot, cos, sin)[1]
    if cache is not None:
        kv_nope, k_rot = cache.update(kv_nope, k_rot, attn.layer_idx, kwargs=kwargs)
    return attn.expand_kv(kv_nope, k_rot)


@dataclass(frozen=True)
class Family:
    """How one architecture's attention is found and split into per-head Q, K, V at run time."""

    config_class: type
    model_class: type
    attention_class: type
    queries: Callable  # (attn, proj or None, hidden, position_embeddings) -> q [B, H, T, dq]
    keys_values: Callable  # (attn, hidden, position_embeddings, cache, kwargs) -> k, v [B, G, S, d]
    sliding_window: Callable = lambda attn: None
    head_dims: Callable = lambda cfg: (cfg.num_attention_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    query_dim: Callable = lambda cfg: getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _llama_queries_or_source(rope):
    inner = _llama_queries(rope)
    return lambda attn, proj, hidden, pos: inner(attn, proj if proj is not None else attn.q_proj, hidden, pos)


_WINDOWS: dict[str | None, Callable] = {
    None: lambda attn: None,
    "config": lambda attn: getattr(attn.config, "sliding_window", None),
    "module": lambda attn: attn.sliding_window,
}


def _runtime_family(desc: Description) -> Family:
    """The runtime side of a family description (`families.py`, shared with the converters)."""
    classes = (desc.config_class(), desc.causal_lm_class(), desc.attention_class())
    if desc.attention == "latent":
        return Family(*classes, _deepseek_queries, _deepseek_keys_values,
                      head_dims=lambda cfg: (cfg.num_attention_heads, cfg.v_head_dim),
                      query_dim=lambda cfg: cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    rope = desc.module().apply_rotary_pos_emb
    return Family(*classes, _llama_queries_or_source(rope), _llama_keys_values(rope),
                  sliding_window=_WINDOWS[desc.sliding_window])


FAMILIES: dict[str, Family] = {name: _runtime_family(d) for name, d in DESCRIPTIONS.items() if d.attention}


# ---------------------------------------------------------------- the retrofitted attention


def _retrofit_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
    family = FAMILIES[self.attnkit_family]
    if cache is None and "past_key_values" in kwargs:  # older call sites
        cache = kwargs.pop("past_key_values")
    bsz, seq = hidden_states.shape[:-1]
    q = family.queries(self, None, hidden_states, position_embeddings)
    k, v = family.keys_values(self, hidden_states, position_embeddings, cache, kwargs)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, _llama.eager_attention_forward)
    extra = {"dropout": 0.0 if not self.training else self.attention_dropout, "scaling": self.scaling}
    window = family.sliding_window(self)
    if window is not None:
        extra["sliding_window"] = window
    titans = getattr(self, "titans", None)
    if titans is not None:  # the source attention over the last W keys (and the slots), the memory mixed in
        out, weights = titans_attention(self, titans, titans_cache_layer(cache, self.layer_idx), attention, q, k, v,
                                        hidden_states, attention_mask, **extra, **kwargs)
    else:
        out, weights = attention(self, q, k, v, attention_mask, **extra, **kwargs)  # out [B, T, H, d_v]
    if hasattr(self, "diff"):
        q2 = family.queries(self, self.diff_q_proj, hidden_states, position_embeddings)
        out2, _ = attention(self, q2, k, v, attention_mask, **extra, **kwargs)
        out = self.diff(out, out2)
    if hasattr(self, "dex"):
        out = self.dex(out)
    out = out.reshape(bsz, seq, -1).contiguous()  # [B, T, H·d_v]
    return self.o_proj(out), weights


_ATTENTION_SUBCLASSES: dict[type, type] = {}


def _retrofit_class(base: type) -> type:
    if base not in _ATTENTION_SUBCLASSES:
        _ATTENTION_SUBCLASSES[base] = type(f"Attnkit{base.__name__}", (base,), {"forward": _retrofit_forward, "__module__": __name__})
    return _ATTENTION_SUBCLASSES[base]


def install_retrofit(model: nn.Module, config, family_name: str) -> None:
    """Give every attention module of `model` the DEX/DIFF/Titans modules that `config.attnkit` asks for."""
    family = FAMILIES[family_name]
    attentions = [m for m in model.modules() if isinstance(m, family.attention_class)]
    if len(attentions) != config.num_hidden_layers:
        raise ValueError(f"found {len(attentions)} {family.attention_class.__name__} modules, expected {config.num_hidden_layers}")
    for attn in attentions:
        install_attention(attn, config, family_name)


def install_attention(attn: nn.Module, config, family_name: str) -> None:
    """Turn one source attention module (layer `attn.layer_idx`) into the retrofitted one, in place: its
    own weights untouched, the method's modules added in their conversion state (exact: ramp 0)."""
    family = FAMILIES[family_name]
    spec = config.attnkit
    method = spec["method"]
    heads, head_dim = family.head_dims(config)
    anneal = float(spec.get("anneal_fraction", 0.25))
    layer = attn.layer_idx
    attn.__class__ = _retrofit_class(type(attn))
    attn.attnkit_family = family_name
    module = runtime_module(method)
    if module == "dex":
        attn.dex = DexHeadMix(heads, head_dim, spec["selected_heads"][layer], layer, anneal)
    elif module == "titans":
        attn.titans = TitansMemory(config.hidden_size, heads, head_dim, spec["memory_dim"], spec["memory_depth"],
                                   spec["window"], spec["chunk"], layer, anneal, int(spec.get("sparse_slots", 0)),
                                   float(spec.get("slot_bias", 0.0)), bool(spec.get("memory_mix", True)))
    else:  # diff
        attn.diff_q_proj = nn.Linear(config.hidden_size, heads * family.query_dim(config), bias=False)
        nn.init.zeros_(attn.diff_q_proj.weight)  # A2 starts as the uniform causal average
        attn.diff = DiffCombine(heads, head_dim, layer, anneal)


RUNTIME_MODULES = ("dex", "diff", "titans")


def runtime_module(method: str) -> str:
    """The module a checkpoint's `attnkit.method` adds to each attention: its last step (`mla+titans` runs
    Titans on an MLA attention). This file runs where attnkit is not installed, so it reads the method
    from the config, not from attnkit's registry."""
    module = method.split("+")[-1]
    if module not in RUNTIME_MODULES:
        raise ValueError(f"unknown attnkit method {method!r}")
    return module


# ---------------------------------------------------------------- config and model classes


def _make_classes(family_name: str, family: Family) -> tuple[type, type]:
    stem = "Attnkit" + family.model_class.__name__.replace("ForCausalLM", "")
    config_class = type(f"{stem}Config", (family.config_class,), {"model_type": f"attnkit_{family_name}", "__module__": __name__})

    def __init__(self, config):
        family.model_class.__init__(self, config)
        install_retrofit(self, config, family_name)

    @functools.wraps(family.model_class.forward)  # its signature: callers see it takes `cache` (not the
    def forward(self, *args, **kwargs):               # deprecated `past_key_values`)
        if runtime_module(self.config.attnkit["method"]) == "titans":  # its bounded cache, not the default one
            kwargs = with_titans_cache(self.config, kwargs)
        return family.model_class.forward(self, *args, **kwargs)

    model_class = type(
        f"{stem}ForCausalLM",
        (family.model_class,),
        {"config_class": config_class, "__init__": __init__, "forward": forward, "__module__": __name__},
    )
    config_class.register_for_auto_class()
    model_class.register_for_auto_class("AutoModelForCausalLM")
    return config_class, model_class


CLASSES: dict[str, tuple[type, type]] = {}
for _name, _family in FAMILIES.items():
    CLASSES[_name] = _make_classes(_name, _family)
    globals()[CLASSES[_name][0].__name__] = CLASSES[_name][0]
    globals()[CLASSES[_name][1].__name__] = CLASSES[_name][1]


def register() -> None:
    """Register every attnkit config/model class with the transformers Auto classes."""
    for config_class, model_class in CLASSES.values():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
