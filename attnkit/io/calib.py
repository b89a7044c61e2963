"""Calibration data and the statistics the MLA converter needs, held for one layer at a time.

Everything the factorisations need is a function of the second moment E[x~ x~^T] of the
augmented layer input x~ = [x; 1] (fp64, accumulated batch by batch), so no activation is kept
beyond the current layer's hidden states.
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from attnkit.data import pack_tokens
from attnkit.errors import AttnkitError


def calibration_tokens(tokenizer, source: str, seq_len: int, n_calib: int, n_eval: int, seed: int):
    """(calibration rows from the train split, held-out rows from the validation split).

    A source with no validation documents (one file) gives its last rows as the held-out set.
    """
    try:
        calib = pack_tokens(tokenizer, source, "train", seq_len, n_calib + n_eval, seed)
    except AttnkitError as exc:
        raise AttnkitError(f"calibration source is empty or too short: {exc}") from None
    try:
        held_out = pack_tokens(tokenizer, source, "validation", seq_len, n_eval, seed)
        note = "validation split"
        calib = calib[: max(1, n_calib // seq_len)]
    except AttnkitError:
        if calib.shape[0] < 2:
            raise AttnkitError(
                f"calibration source {source!r} gives one sequence of {seq_len} tokens; need two (calibration + held-out)"
            ) from None
        n_held = max(1, min(n_eval // seq_len, calib.shape[0] // 2))
        calib, held_out = calib[:-n_held], calib[-n_held:]
        calib = calib[: max(1, n_calib // seq_len)]
        note = "last rows of the calibration text (the source has no validation documents)"
    return calib, held_out, note


class Moment:
    """Running E[x~ x~^T] of x~ = [x; 1] over all tokens seen (fp64)."""

    def __init__(self, dim: int, device="cpu"):
        self.sum = torch.zeros(dim + 1, dim + 1, dtype=torch.float64, device=device)
        self.max_norm = 0.0
        self.normalised = False

    def add(self, x: torch.Tensor) -> None:
        if self.normalised:
            raise RuntimeError("Moment.add after .value")
        flat = x.reshape(-1, x.shape[-1]).double()
        aug = torch.cat([flat, torch.ones(flat.shape[0], 1, dtype=flat.dtype, device=flat.device)], dim=1)
        self.sum += aug.T @ aug
        self.max_norm = max(self.max_norm, float(flat.norm(dim=-1).max()))

    @property
    def value(self) -> torch.Tensor:
        """The moment (normalised in place on first use: the running sum is not kept twice)."""
        if not self.normalised:
            self.sum /= self.sum[-1, -1].clone()
            self.normalised = True
        return self.sum.cpu()


def read_rows(path, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a 2-D tensor in a safetensors file, without reading the rest."""
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        return handle.get_slice(name)[start:stop]


def tensor_rows(ckpt, name: str) -> int:
    with safe_open(str(ckpt.folder / ckpt.weight_map[name]), framework="pt", device="cpu") as handle:
        return handle.get_slice(name).get_shape()[0]


def _embedding_chunks(ckpt, name: str, flat: torch.Tensor, chunk: int):
    """(flat positions, their fp32 embedding vectors) per chunk of table rows that `flat` uses."""
    path = ckpt.folder / ckpt.weight_map[name]
    for lo in range(0, tensor_rows(ckpt, name), chunk):
        where = torch.nonzero((flat >= lo) & (flat < lo + chunk)).flatten()
        if where.numel():
            yield where, read_rows(path, name, lo, lo + chunk).float()[flat[where] - lo]


def embed_into(store, ckpt, name: str, ids: torch.Tensor, chunk: int = 4096) -> None:
    """Embedding lookup of ids [rows, T] written token by token into a RowStore [rows, T, D],
    reading the table a chunk of rows at a time (neither the table nor the result is ever whole)."""
    for where, vectors in _embedding_chunks(ckpt, name, ids.reshape(-1), chunk):
        store.write_tokens(where, vectors)


def embed_rows(ckpt, name: str, ids: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Embedding lookup [*ids.shape, D] (fp32) reading the table a chunk of rows at a time."""
    out = None
    for where, vectors in _embedding_chunks(ckpt, name, ids.reshape(-1), chunk):
        if out is None:
            out = torch.zeros(ids.numel(), vectors.shape[1])
        out[where] = vectors
    return out.view(*ids.shape, -1)
