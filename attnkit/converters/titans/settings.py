"""Titans conversion settings: what is refused (before any work), the config's `attnkit` block, and
where the memory's query/key/value projections start.

Why these limits: the window W is a count of tokens the attention still sees, so 1 <= W <= the
model's context; a chunk of C tokens is written to memory only once complete and its tokens read the
memory of the chunks before, so a chunk must fit in the window (C <= W) or its oldest tokens would be
seen by neither. Chunk boundaries count from the first token and a partial last chunk waits in the
cache, so C need not divide any training length. Depth 0 is the window alone (no memory): the
baseline a Titans model is measured against, healed the same way.
"""

from __future__ import annotations

import math

import torch

from attnkit.errors import AttnkitError

DEFAULT_WINDOW, DEFAULT_CHUNK, DEFAULT_DEPTH = 128, 16, 2
MAX_DEPTH = 4


def head_sizes(config: dict) -> tuple[int, int]:
    """(query heads, value head size) of a source config dict (MLA: v_head_dim)."""
    heads = int(config["num_attention_heads"])
    value = config.get("v_head_dim") or config.get("head_dim") or config["hidden_size"] // heads
    return heads, int(value)


def check_settings(window: int, chunk: int, depth: int, memory_dim: int | None, config: dict, slots: int = 0,
                   slot_bias: float = -1.0, gate: str = "open") -> dict:
    """The validated settings (memory_dim defaulting to the value head size), or AttnkitError."""
    context = int(config.get("max_position_embeddings") or 0)
    if window < 1 or (context and window > context):
        raise AttnkitError(f"--window must be between 1 and the model's context ({context} tokens), got {window}")
    if chunk < 1 or chunk > window:
        raise AttnkitError(f"--chunk must be between 1 and --window ({window}): a chunk's tokens are in the window "
                           f"until the memory has read them; got {chunk}")
    if not 0 <= depth <= MAX_DEPTH:
        raise AttnkitError(f"--memory-depth must be between 0 (the window alone, no memory) and {MAX_DEPTH}, got {depth}")
    hidden = int(config["hidden_size"])
    dim = head_sizes(config)[1] if memory_dim is None else memory_dim
    if not 1 <= dim <= hidden:
        raise AttnkitError(f"--memory-dim must be between 1 and hidden_size ({hidden}): each head's memory key is "
                           f"a projection of the hidden state; got {dim}")
    if slots < 0 or (slots and not depth):
        raise AttnkitError(f"--sparse-slots must be 0 or more, and needs a memory (--memory-depth >= 1): its "
                           f"surprise chooses the tokens kept; got {slots} with depth {depth}")
    if not math.isfinite(slot_bias):
        raise AttnkitError(f"--slot-bias must be a finite number (a shift of the slots' attention logits), got {slot_bias}")
    if gate == "shut" and not slots:
        raise AttnkitError("--memory-gate shut needs --sparse-slots S >= 1: with the gate shut the memory only chooses "
                           "the slots, and with none it is the window alone (--memory-depth 0)")
    return {"window": window, "chunk": chunk, "memory_depth": depth, "memory_dim": dim, "sparse_slots": slots,
            "slot_bias": float(slot_bias), "memory_mix": gate == "open"}


def titans_config_fields(settings: dict, anneal_fraction: float, base_model_type: str, method: str = "titans") -> dict:
    """The `attnkit` block of a Titans model's config (`method`: titans, or mla+titans on an MLA output)."""
    return {"method": method, "base_model_type": base_model_type, "variant": "mag",
            "anneal_fraction": float(anneal_fraction), **settings}


def memory_projections_from(attn, heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Start values for the memory's q/k/v projections [H·d, D] from the layer's own q/k/v (a
    rotate-half family, memory_dim = head_dim): the memory reads with the layer's query, keys with
    its key and stores its value; biases are left out (the memory projections have none)."""
    out = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(attn, name).weight.detach()  # [G·d, D]
        per_head = w.view(-1, head_dim, w.shape[-1])  # [G, d, D]
        out[name] = per_head.repeat_interleave(heads // per_head.shape[0], dim=0).reshape(heads * head_dim, -1)
    return out
