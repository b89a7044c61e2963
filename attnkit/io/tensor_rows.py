"""Row reads of 2-D safetensors tensors: a slice of rows, the row count, and embedding lookups
that read the table a chunk of rows at a time (neither the table nor the result is ever whole)."""

from __future__ import annotations

import torch
from safetensors import safe_open


def read_rows(path, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a 2-D tensor in a safetensors file, without reading the rest."""
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        return handle.get_slice(name)[start:stop]


def tensor_rows(ckpt, name: str) -> int:
    with safe_open(str(ckpt.folder / ckpt.weight_map[name]), framework="pt", device="cpu") as handle:
        return handle.get_slice(name).get_shape()[0]


def _embedding_chunks(ckpt, name: str, flat: torch.Tensor, chunk: int, scale: float | None = None):
    """(flat positions, their fp32 embedding vectors, times `scale` if given) per chunk of table rows that
    `flat` uses."""
    path = ckpt.folder / ckpt.weight_map[name]
    for lo in range(0, tensor_rows(ckpt, name), chunk):
        where = torch.nonzero((flat >= lo) & (flat < lo + chunk)).flatten()
        if where.numel():
            vectors = read_rows(path, name, lo, lo + chunk).float()[flat[where] - lo]
            yield where, vectors if scale is None else vectors * scale


def embed_into(store, ckpt, name: str, ids: torch.Tensor, chunk: int = 4096, scale: float | None = None) -> None:
    """Embedding lookup of ids [rows, T] written token by token into a RowStore [rows, T, D]."""
    for where, vectors in _embedding_chunks(ckpt, name, ids.reshape(-1), chunk, scale):
        store.write_tokens(where, vectors)
