"""KV-cache size measured from the cache object a model really builds, never from a formula.

A formula (2·layers·G·d·bytes for GQA, (r + d_r)·layers·bytes for MLA) is what we want to *check*;
so we run a forward pass, walk the `Cache` it returns, and count the bytes of the tensors it holds.
Two prompt lengths are measured and differenced, so constant state (if any) does not count per token.
"""

from __future__ import annotations

from typing import Any

import torch

from attnkit.errors import AttnkitError

# the two prompt lengths whose difference gives bytes/token (small: this runs inside `attnkit eval`)
_SHORT, _LONG = 4, 12


def _layer_tensors(layer: Any) -> list[torch.Tensor]:
    """Every tensor a cache layer holds (keys, values, and any extra state a subclass adds)."""
    return [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]


def cache_layer_bytes(layer: Any) -> int:
    """Bytes held by one cache layer; views of one storage are counted once, by their storage.

    A layer that grows in blocks (attnkit's `LatentLayer`) reports its stored tokens via `stored_bytes()`.
    """
    if hasattr(layer, "stored_bytes"):
        return int(layer.stored_bytes())
    seen: dict[tuple[str, int], int] = {}
    for t in _layer_tensors(layer):
        if t.numel() == 0:
            continue
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def cache_bytes(cache: Any) -> list[int]:
    """Bytes per layer held by a transformers `Cache` (or a legacy tuple of (k, v) per layer)."""
    if cache is None:
        raise AttnkitError("the model returned no KV cache (use_cache=True had no effect)")
    layers = getattr(cache, "layers", None)
    if layers is None:  # legacy tuple-of-tuples cache
        return [sum(t.numel() * t.element_size() for t in layer if isinstance(t, torch.Tensor)) for layer in cache]
    return [cache_layer_bytes(layer) for layer in layers]


def describe_cache(cache: Any) -> list[dict]:
    """Per layer: the class and the stored tensor shapes/dtypes (what the cache *really* stores)."""
    out = []
    for layer in getattr(cache, "layers", []):
        named = {"keys": layer.keys, "values": layer.values, **vars(layer)}
        tensors = {k: v for k, v in named.items() if isinstance(v, torch.Tensor) and v.numel() > 0 and not k.startswith("_")}
        out.append(
            {
                "class": type(layer).__name__,
                "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in tensors.items()},
            }
        )
    return out


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@torch.no_grad()
def run_for_cache(model: torch.nn.Module, batch: int, seq_len: int) -> Any:
    """One forward pass over `batch × seq_len` token ids; returns the cache the model filled."""
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    # [batch, seq_len] deterministic ids inside the vocabulary
    ids = (torch.arange(batch * seq_len) % max(vocab - 1, 1) + 1).view(batch, seq_len).to(_model_device(model))
    out = model(input_ids=ids, use_cache=True)
    found = getattr(out, "cache", None)
    if found is None:
        found = getattr(out, "past_key_values", None)
    return found


def kv_cache_bytes_per_token(model: torch.nn.Module) -> dict:
    """Measure KV-cache bytes per token (batch 1) from the cache the model builds in a forward pass.

    Returns `{"total": int, "per_layer": [int], "layers": int, "dtype": str, "cache_class": str,
    "layer_class": str, "stored": [{"class", "tensors": {name: {"shape", "dtype"}}}], "method": str}`.
    `total` is bytes per token summed over layers; `stored` describes layer tensors at `_LONG` tokens.
    """
    was_training = model.training
    model.eval()
    try:
        short = cache_bytes(run_for_cache(model, 1, _SHORT))
        long_cache = run_for_cache(model, 1, _LONG)
        long = cache_bytes(long_cache)
    finally:
        model.train(was_training)
    if len(short) != len(long):
        raise AttnkitError("the model's cache changed its number of layers between two forward passes")
    span = _LONG - _SHORT
    per_layer = []
    for s, lg in zip(short, long):
        if (lg - s) % span:
            raise AttnkitError(f"cache bytes do not grow linearly with tokens ({s} B at {_SHORT}, {lg} B at {_LONG})")
        per_layer.append((lg - s) // span)
    dtypes = {str(t.dtype).replace("torch.", "") for layer in getattr(long_cache, "layers", []) for t in _layer_tensors(layer)}
    layers = getattr(long_cache, "layers", [])
    return {
        "total": int(sum(per_layer)),
        "per_layer": [int(b) for b in per_layer],
        "layers": len(per_layer),
        "dtype": ",".join(sorted(dtypes)),
        "cache_class": type(long_cache).__name__,
        "layer_class": type(layers[0]).__name__ if layers else "",
        "stored": describe_cache(long_cache),
        "method": f"forward pass at {_SHORT} and {_LONG} tokens, batch 1; difference of cache tensor bytes",
    }
