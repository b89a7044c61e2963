"""`attnkit convert --to titans` and `--to mla+titans`: the shared in-place retrofit (`converters/retrofit.py`) with Titans'
fields, the memory projections started from the layer's own q/k/v, and the state measured at a few
context lengths (it must stop growing at the window)."""

from __future__ import annotations

import argparse

import torch

from attnkit.adapters.families import FAMILIES
from attnkit.converters.retrofit import ANNEAL_FRACTION, retrofit, retrofit_after_mla
from attnkit.converters.titans.settings import check_settings, head_sizes, memory_projections_from, titans_config_fields
from attnkit.errors import AttnkitError
from attnkit.evaluation.kv import cache_bytes, run_for_cache
from attnkit.io.resolve import check_causal_lm, resolve_model


def convert_titans(args: argparse.Namespace) -> int:
    return retrofit(args, "titans", _checked_fields(args), _init_memory)


def convert_mla_titans(args: argparse.Namespace) -> int:
    """MLA first, then Titans on its DeepSeek-V3 output: the settings are checked against the user's
    model before the long MLA step (MLA keeps its context, hidden size and value head size)."""
    return retrofit_after_mla(args, "mla+titans", _checked_fields(args), _init_memory)


def _checked_fields(args: argparse.Namespace):
    """The retrofit's fields callback, after refusing bad settings before any work (a model of
    another family: the retrofit says why)."""
    config = check_causal_lm(resolve_model(args.model))
    if config.get("model_type") in FAMILIES and FAMILIES[config["model_type"]].attention:
        _settings(args, config)

    def fields(args: argparse.Namespace, stats: dict, model_type: str, layers: int) -> tuple[dict, dict]:
        return titans_config_fields(_settings(args, config), ANNEAL_FRACTION, model_type), {}

    return fields


def _settings(args: argparse.Namespace, config: dict) -> dict:
    if getattr(args, "variant", "mag") != "mag":
        raise AttnkitError(f"--variant {args.variant} (memory as a layer) is not implemented yet; --variant mag "
                           f"(memory as a gate) is")
    return check_settings(args.window, args.chunk, args.memory_depth, args.memory_dim, config)


def _init_memory(model: torch.nn.Module, stats: dict) -> dict:
    """Memory q/k/v from the layer's own projections where the sizes match (rotate-half families,
    memory_dim = head_dim); otherwise they keep their seeded random start. Then the state bytes."""
    spec = model.config.attnkit
    heads, head_dim = head_sizes(model.config.to_dict())
    family = FAMILIES[spec["base_model_type"]]
    from_source = family.attention == "rotate_half" and spec["memory_dim"] == head_dim and spec["memory_depth"] > 0
    for attn in (m for m in model.modules() if hasattr(m, "titans")):
        if from_source:
            for name, weight in memory_projections_from(attn, heads, head_dim).items():
                getattr(attn.titans, name).weight.data.copy_(weight)
    return {"titans": {**{k: spec[k] for k in ("window", "chunk", "memory_depth", "memory_dim", "variant")},
                       "memory_qkv_init": ("none: the window alone" if not spec["memory_depth"] else
                                           "the layer's q/k/v (KV heads repeated)" if from_source else "seeded random"),
                       "state_bytes": state_bytes(model, spec["window"])},
            "kv_cache_effect": ("bounded: the last W-1 keys/values per layer plus the memory state (fp32) and the "
                                "< C tokens read since its last chunk; kv_cache_bytes_per_token.after is the growth "
                                "below W (window keys/values and pending memory writes), none past W")}


def state_bytes(model: torch.nn.Module, window: int) -> dict:
    """Bytes the cache holds after one forward pass at 1, 2 and 4 windows (batch 1), in the
    model's dtype as converted (fp32 here; the memory state stays fp32 in any dtype)."""
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 4 * window)
    contexts = sorted({min(n * window, limit) for n in (1, 2, 4)})
    # prefilled a window at a time, as served: one pass over 4 windows would build a [4W, 4W] mask
    return {"contexts": contexts, "bytes": [sum(cache_bytes(run_for_cache(model, 1, n, chunk=window))) for n in contexts]}
