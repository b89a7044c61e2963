"""KV-cache size measured from the cache object a model really builds, never from a formula.

A formula (2·layers·G·d·bytes for GQA, (r + d_r)·layers·bytes for MLA) is what we want to *check*;
so we run a forward pass, walk the `Cache` it returns, and count the bytes of the tensors it holds.
Two prompt lengths are measured and differenced, so constant state (if any) does not count per token.

One convention for every figure attnkit prints (convert's report, eval, bench): KV bytes per token
at the dtype the checkpoint is stored in (what `from_pretrained` loads it as by default, so what it
is served in), with that dtype named beside the number (`format_kv`). A cache measured in another
dtype (eval and bench run fp32 by default) is counted in the stored one by `kv_as_stored`, and the
measured figure is kept beside it with its own dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from attnkit.errors import AttnkitError

SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64",
                "F32": "fp32", "BF16": "bf16", "F16": "fp16", "F64": "fp64"}
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}

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
@torch.no_grad()  # a measurement: no graph
def run_for_cache(model: torch.nn.Module, batch: int, seq_len: int, chunk: int | None = None) -> Any:
    """A forward pass over `batch × seq_len` token ids; returns the cache the model filled. `chunk`:
    prefill `chunk` tokens at a time into the same cache, as a server does, so a bounded-attention
    model (Titans' window) never builds its [T, T] mask over the whole context."""
    import inspect

    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    # [batch, seq_len] deterministic ids inside the vocabulary
    ids = (torch.arange(batch * seq_len) % max(vocab - 1, 1) + 1).view(batch, seq_len).to(_model_device(model))
    cache = None
    for start in range(0, seq_len, chunk or seq_len):
        piece = ids[:, start:start + (chunk or seq_len)]
        extra = {} if cache is None else {cache_keyword(model): cache}
        cache = returned_cache(model(input_ids=piece, use_cache=True, **extra))
    return cache


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword this model's forward takes its cache by (`cache` in transformers ≥ 5.x)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(out) -> Any:
    found = getattr(out, "cache", None)
    return found if found is not None else getattr(out, "past_key_values", None)


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
    dtypes = {str(t.dtype).replace("torch.", "") for layer in getattr(long_cache, "layers", []) for t in _layer_tensors(layer)
              if t.is_floating_point()}  # the values' dtype: a sliding-window layer also holds an int64 index
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


def short_dtype(dtype: torch.dtype | str | None) -> str:
    """torch.bfloat16, 'bfloat16' or 'BF16' -> 'bf16' (the names --dtype takes); anything else as given."""
    name = str(dtype).replace("torch.", "")
    return SHORT_DTYPES.get(name, name)


def kv_as_stored(measured_bytes: int, measured_dtype: torch.dtype | str, stored_dtype: torch.dtype | str) -> dict:
    """{"bytes_per_token", "dtype"}: a cache measured in one dtype, counted in the dtype the checkpoint is
    stored in (a cache holds its values in the model's dtype, so the count scales with the item size).
    A cache of mixed or unknown dtype is not rescaled: its own figure and dtype are returned."""
    measured, stored = _TORCH_DTYPES.get(short_dtype(measured_dtype)), _TORCH_DTYPES.get(short_dtype(stored_dtype))
    if measured is None or stored is None:
        return {"bytes_per_token": int(measured_bytes), "dtype": short_dtype(measured_dtype)}
    return {"bytes_per_token": int(measured_bytes) * stored.itemsize // measured.itemsize, "dtype": short_dtype(stored)}


def format_kv(bytes_per_token: int, dtype: torch.dtype | str, note: str | None = None) -> str:
    """'2,048 B/token (bf16)' or, with a note, '2,048 B/token (bf16, as stored)': every printed KV figure names its dtype."""
    return f"{int(bytes_per_token):,} B/token ({short_dtype(dtype)}{', ' + note if note else ''})"


def kv_change(kv: dict) -> str:
    """A convert report's 'KV cache: 4,096 -> 1,216 B/token (bf16), 29.7 % of the source' line (both counts
    in the output's dtype, `kv["dtype"]`)."""
    line = f"KV cache: {int(kv['before']):,} -> {format_kv(kv['after'], kv.get('dtype', '?'))}"
    return line + (f", {100 * kv['after'] / kv['before']:.1f} % of the source" if kv.get("before") else "")


def checkpoint_dtype(folder) -> str | None:
    """The dtype a checkpoint's weights are stored in ('bf16', ...), from its safetensors headers (no
    data read): that of its projection/norm weights; None when the folder has no safetensors."""
    from attnkit.io.checkpoint import INDEX_FILE, SINGLE_FILE, LazyCheckpoint

    if not any((Path(folder) / f).is_file() for f in (SINGLE_FILE, INDEX_FILE)):
        return None
    header = LazyCheckpoint(folder).header()
    names = [n for n in sorted(header) if n.endswith(("proj.weight", "norm.weight"))] or sorted(header)
    return short_dtype(header[names[0]]["dtype"]) if names else None


def bounded_state_note(titans: dict) -> str:
    """What a convert report's per-token KV figure does not say for a Titans model (its `titans`
    block): that figure is the growth below W only; past W the state is constant."""
    state = titans["state_bytes"]
    sizes = ", ".join(f"{b:,} B at {n:,}" for n, b in zip(state["contexts"], state["bytes"]))
    memory = "no memory" if not titans["memory_depth"] else "the memory"
    if titans.get("sparse_slots"):
        memory += f" + {titans['sparse_slots']} kept tokens' keys/values per KV head (sparse slots)"
    return (f"bounded: the last {titans['window'] - 1} tokens' keys/values per layer + {memory}; the per-token "
            f"figure is the growth below W = {titans['window']}, none past it (whole cache, fp32: {sizes} tokens)")
