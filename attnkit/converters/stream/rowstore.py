"""Hidden states kept on disk, one row at a time in memory.

The converter pushes calibration and held-out text through the model layer by layer. Held in
memory, those states would cost rows x seq_len x D x 4 bytes (65k calibration tokens of a
D = 4096 model: 1 GB) on top of the layer being converted. A `RowStore` keeps them in a scratch
file instead and is read and rewritten a batch of rows at a time with plain file I/O (not mmap,
whose touched pages would count as resident memory).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


class RowStore:
    """A float32 tensor [rows, *row_shape] in a scratch file."""

    def __init__(self, path: Path, rows: int, row_shape: tuple[int, ...]):
        self.path, self.rows, self.row_shape = Path(path), rows, tuple(row_shape)
        self.row_numel = int(torch.Size(self.row_shape).numel())
        with open(self.path, "wb") as f:
            f.truncate(rows * self.row_numel * 4)
        self._file = open(self.path, "r+b")

    @classmethod
    def from_tensor(cls, path: Path, t: torch.Tensor) -> "RowStore":
        store = cls(path, t.shape[0], tuple(t.shape[1:]))
        store.write(0, t)
        return store

    def copy(self, path: Path, rows: int = 64) -> "RowStore":
        other = RowStore(path, self.rows, self.row_shape)
        for lo, block in self.blocks(rows):
            other.write(lo, block)
        return other

    def read(self, lo: int, hi: int) -> torch.Tensor:
        hi = min(hi, self.rows)
        out = torch.empty(hi - lo, *self.row_shape, dtype=torch.float32)
        self._file.seek(lo * self.row_numel * 4)
        self._file.readinto(memoryview(out.numpy()).cast("B"))
        return out

    def write(self, lo: int, t: torch.Tensor) -> None:
        t = t.detach().to("cpu", torch.float32).contiguous()
        self._file.seek(lo * self.row_numel * 4)
        self._file.write(memoryview(t.numpy()).cast("B"))

    def write_tokens(self, index: torch.Tensor, vectors: torch.Tensor) -> None:
        """Write vectors [n, D] at flat token positions `index` [n] (a row store of [T, D] rows)."""
        width = self.row_shape[-1] * 4
        data = vectors.detach().to("cpu", torch.float32).contiguous()
        view = memoryview(data.numpy()).cast("B")
        for k, pos in enumerate(index.tolist()):
            self._file.seek(pos * width)
            self._file.write(view[k * width : (k + 1) * width])

    def blocks(self, rows: int = 1) -> Iterator[tuple[int, torch.Tensor]]:
        for lo in range(0, self.rows, rows):
            yield lo, self.read(lo, lo + rows)

    def map_(self, fn: Callable[[torch.Tensor], torch.Tensor], rows: int = 1, device: str | torch.device = "cpu") -> None:
        """Replace every block of rows by fn(block) (same shape), on `device`."""
        with torch.no_grad():
            for lo, block in self.blocks(rows):
                self.write(lo, fn(block.to(device)))

    def all(self) -> torch.Tensor:
        return self.read(0, self.rows)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self.path.exists():
            os.remove(self.path)
