"""`attnkit convert --to titans` and `--to mla+titans`: the shared in-place retrofit (`converters/retrofit.py`) with Titans'
fields, the memory projections started from the layer's own q/k/v, and the state measured at a few
context lengths (it must stop growing at the window)."""

from __future__ import annotations

import argparse

import torch

from attnkit.adapters.families import FAMILIES
from attnkit.converters.retrofit import ANNEAL_FRACTION, RetrofitMethod, retrofit, retrofit_after_mla
from attnkit.converters.retrofit_stream import per_layer_measure
from attnkit.converters.titans.settings import check_settings, head_sizes, memory_projections_from, titans_config_fields
from attnkit.errors import AttnkitError
from attnkit.evaluation.kv import cache_bytes, run_for_cache
from attnkit.io.resolve import check_causal_lm, resolve_model

PREFILL_TOKENS = 512  # tokens per forward when the state is measured (state_bytes)


def convert_titans(args: argparse.Namespace) -> int:
    return retrofit(args, _method("titans", args))


def convert_mla_titans(args: argparse.Namespace) -> int:
    """MLA first, then Titans on its DeepSeek-V3 output: the settings are checked against the user's
    model before the long MLA step (MLA keeps its context, hidden size and value head size)."""
    return retrofit_after_mla(args, _method("mla+titans", args))


def _method(name: str, args: argparse.Namespace) -> RetrofitMethod:
    """The retrofit's callbacks, after refusing bad settings before any work (a model of another
    family: the retrofit says why)."""
    config = check_causal_lm(resolve_model(args.model))
    if config.get("model_type") in FAMILIES and FAMILIES[config["model_type"]].attention:
        _settings(args, config)

    def fields(args: argparse.Namespace, stats: dict, model_type: str, layers: int) -> tuple[dict, dict]:
        return titans_config_fields(_settings(args, config), ANNEAL_FRACTION, model_type, name), {}

    return RetrofitMethod(name, fields, _init_memory, _report_extras)


def _settings(args: argparse.Namespace, config: dict) -> dict:
    if getattr(args, "variant", "mag") != "mag":
        raise AttnkitError(f"--variant {args.variant} (memory as a layer) is not implemented yet; --variant mag "
                           f"(memory as a gate) is")
    return check_settings(args.window, args.chunk, args.memory_depth, args.memory_dim, config,
                          getattr(args, "sparse_slots", 0), getattr(args, "slot_bias", -1.0),
                          getattr(args, "memory_gate", "open"))


def _from_source(family_name: str, memory_dim: int, memory_depth: int, source_config: dict) -> bool:
    """Whether the memory's q/k/v start from the layer's own (rotate-half families, memory_dim = head_dim);
    otherwise they keep their seeded random start."""
    _, head_dim = head_sizes(source_config)
    return FAMILIES[family_name].attention == "rotate_half" and memory_dim == head_dim and memory_depth > 0


def _init_memory(attn: torch.nn.Module, stats: dict) -> None:
    source = attn.config.to_dict()  # the source layer's config: the shapes the projections are cut from
    if _from_source(attn.attnkit_family, attn.titans.memory_dim, len(attn.titans.initial), source):
        heads, head_dim = head_sizes(source)
        for name, weight in memory_projections_from(attn, heads, head_dim).items():
            getattr(attn.titans, name).weight.data.copy_(weight)


def _report_extras(config, model_class: type) -> dict:
    """How the memory started, and the state bytes at 1, 2 and 4 windows (it must stop growing)."""
    spec = config.attnkit
    return {"titans": {**{k: spec[k] for k in ("window", "chunk", "memory_depth", "memory_dim", "variant")},
                       "sparse_slots": int(spec.get("sparse_slots", 0)),
                       **({"slot_bias": float(spec.get("slot_bias", 0.0)),
                           "memory_gate": "open" if spec.get("memory_mix", True) else "shut"} if spec.get("sparse_slots") else {}),
                       "memory_qkv_init": ("none: the window alone" if not spec["memory_depth"] else
                                           "the layer's q/k/v (KV heads repeated)" if _from_source(spec["base_model_type"], spec["memory_dim"],
                                                                                   spec["memory_depth"], config.to_dict())
                                           else "seeded random"),
                       "state_bytes": state_bytes(config, model_class)},
            "kv_cache_effect": ("bounded: the last W-1 keys/values per layer, the S sparse slots per KV head (if any), "
                                "the memory state (fp32) and the < C tokens read since its last chunk; "
                                "kv_cache_bytes_per_token.after is the growth below W (window keys/values and pending "
                                "memory writes), none past W")}


def state_bytes(config, model_class: type) -> dict:
    """Bytes the cache holds after one forward pass at 1, 2 and 4 windows (batch 1), in fp32 (the
    memory state stays fp32 in any dtype): one layer's, measured on a one-layer twin of each layer
    type, summed over the layers."""
    window = config.attnkit["window"]
    limit = int(getattr(config, "max_position_embeddings", 0) or 4 * window)
    contexts = sorted({min(n * window, limit) for n in (1, 2, 4)})
    # prefilled at most 512 tokens at a time, as served: one pass over 4 windows would build a [4W, 4W] mask,
    # and a whole 4,096-token window through a 1B-wide memory held 0.7 GB; the state is the same whatever
    # the prefill chunk (measured at several)
    step = min(window, PREFILL_TOKENS)
    measure = lambda twin: [sum(cache_bytes(run_for_cache(twin, 1, n, chunk=step))) for n in contexts]  # noqa: E731
    per_layer = per_layer_measure(config, model_class, measure)
    return {"contexts": contexts, "bytes": [sum(layer[i] for layer in per_layer) for i in range(len(contexts))]}


def summary(report: dict) -> tuple[str | None, list[str]]:
    """The printout's Titans lines: the bounded state on the KV line, the memory's shape and the state measured."""
    from attnkit.evaluation.kv import bounded_state_note

    t = report["titans"]
    state = ", ".join(f"{b:,} B at {n}" for n, b in zip(t["state_bytes"]["contexts"], t["state_bytes"]["bytes"]))
    slots = (f", {t['sparse_slots']} sparse slots per KV head (logits {t.get('slot_bias', 0.0):+g}, gate "
             f"{t.get('memory_gate', 'open')})" if t.get("sparse_slots") else "")
    return bounded_state_note(t), [f"Titans: window {t['window']}, chunk {t['chunk']}, memory depth {t['memory_depth']} "
                                   f"x dim {t['memory_dim']}{slots}; whole cache after a forward pass (fp32): {state} tokens"]
