"""The one streaming engine: every walk through a source's decoder layers (MLA and GQA conversion,
the RoPE-score pre-pass, the `--kv-budget` candidates, the retrofits' passes) goes through
`stream_layers`, so that what keeps its memory at one layer is written once.

A method gives a per-layer hook, `step(layer, module)`: the engine reads the layer (fp32 on the
device, its MLP as asked), calls the hook, drops the layer and hands the freed memory back to the OS
before the next one is read. The hook does the method's work on that layer: advance its hidden-state
streams (`finish_layer` for the usual attention-then-MLP order), compute statistics, write tensors.
A callback, not a generator: a caller's loop variable would keep the previous layer alive while the
next one loads, doubling the peak.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar

import torch
from tqdm.auto import tqdm

from attnkit.converters.measure import SourceAttention, return_freed_memory
from attnkit.converters.mla.progress import ConversionProgress
from attnkit.converters.mla.source import ROW_BATCH, Source, load_layer, load_mlp
from attnkit.converters.stream.rowstore import RowStore

T = TypeVar("T")
Step = Callable[[int, torch.nn.Module], T]  # (layer index, the loaded decoder layer) -> what the walk collects
# "every": each layer whole; "deferred": attention only, the hook calls `load_mlp` (or `finish_layer`) when the
# stages it built are gone; "not last": the last layer's MLP is never read (its output is not used)
MlpLoad = Literal["every", "deferred", "not last"]


def stream_layers(src: Source, device: str, step: Step[T], desc: str | None = None, *,
                  progress: ConversionProgress | None = None, mlp: MlpLoad = "every", by_rows: bool = False,
                  leave: bool = True) -> list[T]:
    """`step(layer, module)` for every decoder layer in order, each layer freed before the next is
    read; returns what the steps returned. The bar: the walk `desc` of `progress` (the conversion's
    one bar over its walks), else a tqdm bar described `desc` (none when `desc` is None). `by_rows`:
    the MLP runs a row at a time (`mlp_by_rows`)."""
    n = src.config["num_hidden_layers"]
    bar = progress.walk(desc) if progress is not None else tqdm(
        range(n), desc=desc, unit="layer", leave=leave, disable=desc is None)
    out = []
    for layer in bar:
        module = load_layer(src, layer, device, mlp=mlp == "every" or (mlp == "not last" and layer < n - 1))
        if by_rows:
            mlp_by_rows(module)
        out.append(step(layer, module))
        if by_rows:  # the wrapper's closure refers back to the MLP: a cycle that only the garbage
            del module.mlp.forward  # collector would free, keeping every layer alive until it ran
        del module
        return_freed_memory(trim=True)
    return out


def last_layer(src: Source, layer: int) -> bool:
    """Whether `layer` is the source's last: what it outputs is read only by the final norm."""
    return layer == src.config["num_hidden_layers"] - 1


def mlp_by_rows(module: torch.nn.Module) -> torch.nn.Module:
    """The layer's MLP applied one row (sequence) of a batch at a time: the same numbers per token,
    and [T, intermediate] temporaries instead of [B·T, intermediate] ones (the calibration batches
    take 4,096 tokens at once: 0.5 GB of them on a 1B model). The attention still sees the batch, so
    the statistics are summed in the same order as the whole model's."""
    mlp = module.mlp
    whole = mlp.forward

    def by_rows(x: torch.Tensor) -> torch.Tensor:  # x [B, T, D]
        return whole(x) if x.dim() != 3 or x.shape[0] == 1 else torch.cat([whole(x[i : i + 1]) for i in range(x.shape[0])])

    mlp.forward = by_rows  # an instance attribute: the module's structure and state_dict are unchanged
    return module


@torch.no_grad()
def finish_layer(module: torch.nn.Module, src: Source, layer: int, device: str, norms: tuple, source_attn,
                 ref: SourceAttention | None, streams: dict[str, RowStore], h_cal: RowStore | None) -> None:
    """The rest of a layer for every stream once each measured stage has added its own attention
    residual (`measure.measure_stage`): h + post1(attn(norm1(h))) for the source stream (from `ref`,
    its attention computed once and closed here; None: computed now) and for the calibration rows
    `h_cal` (None: not read after this layer), then h + post2(mlp(norm2(h))) for all of them. The MLP
    is loaded only now, so that it is never resident together with the stages."""
    norm1, post1, norm2, post2 = norms  # `source.layer_norms`: identity where the family has none
    source = streams["source"]
    if ref is None:
        source.map_(lambda h: h + post1(source_attn(norm1(h))), ROW_BATCH, device)
    else:
        for lo, _, y in ref.blocks(device):
            source.write(lo, source.read(lo, lo + ROW_BATCH).to(device) + post1(y))
        ref.close()
    if h_cal is not None:
        h_cal.map_(lambda h: h + post1(source_attn(norm1(h))), ROW_BATCH, device)
    load_mlp(module, src, layer, device)
    for store in (*streams.values(), *(() if h_cal is None else (h_cal,))):
        store.map_(lambda h: h + post2(module.mlp(norm2(h))), ROW_BATCH, device)
