"""The tensors around the decoder layers (embedding, final norm, LM head): written the same way by every
converter once its layer walk is done, and never whole in memory when they are large."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from attnkit.converters.mla.source import Source, lm_head_name
from attnkit.io.checkpoint import ShardedWriter
from attnkit.io.stream_copy import merge_index, stream_tensors

STREAM_COPY_BYTES = 256 * 2**20  # an embedding or head above this is copied a block of rows at a time
EMBEDDINGS_FILE = "model-embeddings.safetensors"


def write_outside_layers(src: Source, folder: Path, writer: ShardedWriter, out_dtype: torch.dtype,
                         names: dict[str, str] | None = None, stream_above: int = STREAM_COPY_BYTES) -> None:
    """Write `names` ({output name: source tensor}; by default the source's own final norm, embedding and
    untied head, under their names) in `out_dtype`, and close `writer`. A 2-D tensor of more than
    `stream_above` output bytes is copied a block of rows at a time into a file of its own
    (`EMBEDDINGS_FILE`, merged into the index); the rest go through `writer`, so that a small model's
    stay in the one `model.safetensors` that `save_pretrained` leaves."""
    if names is None:  # a dict: a tied head is the embedding, written once
        names = {n: n for n in (src.family.final_norm + ".weight", src.family.embed + ".weight", lm_head_name(src))}
    shapes = src.ckpt.shapes()
    streamed = [(out, name, 1.0) for out, name in names.items()
                if len(shapes[name]) == 2 and math.prod(shapes[name]) * out_dtype.itemsize > stream_above]
    for out, name in names.items():
        if (out, name, 1.0) not in streamed:
            writer.add(out, src.ckpt.get(name, dtype=torch.float32).to(out_dtype))
    writer.close()
    if streamed:
        merge_index(folder, EMBEDDINGS_FILE, stream_tensors(src.ckpt, streamed, folder / EMBEDDINGS_FILE, out_dtype))
