"""Running a streamed conversion's held-out text through the source and through each step of the
conversion, layer by layer, and comparing them (the per-step report of `convert --to mla` and
`--to gqa`); and handing a layer's freed memory back to the OS between layers."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from attnkit.converters.mla.metrics import ErrorStat, logits_metrics, relative_errors
from attnkit.converters.mla.source import ROW_BATCH, Source, final_hidden, final_softcap, head_chunks
from attnkit.io.rowstore import RowStore


def return_freed_memory(trim: bool = False) -> None:
    """Large tensors freed by one layer go back to the OS (glibc otherwise keeps them in its heap):
    a fixed 1 MiB mmap threshold (glibc's own grows with what is freed, up to 32 MiB); `trim` also
    hands back the free pages inside the heap (what tokenising the calibration text and a layer's
    small tensors leave behind)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        if trim:
            libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass




@dataclass
class SourceAttention:
    """The source attention's inputs (normed) and outputs on the held-out rows of one layer, computed
    once and compared with every stage; kept in scratch files beside the source stream."""

    inputs: RowStore
    outputs: RowStore

    @classmethod
    def of(cls, source_attn, norm1, source: RowStore, dev: str) -> "SourceAttention":
        ref = cls(*(RowStore(source.path.with_name(f"source-{k}.f32"), source.rows, source.row_shape) for k in ("in", "out")))
        for lo, h in source.blocks(ROW_BATCH):
            x = norm1(h.to(dev))
            ref.inputs.write(lo, x)
            ref.outputs.write(lo, source_attn(x))
        return ref

    def blocks(self, dev: str):
        """(first row, normed input, source attention output) per block of rows, on `dev`."""
        for lo, x in self.inputs.blocks(ROW_BATCH):
            yield lo, x.to(dev), self.outputs.read(lo, lo + ROW_BATCH).to(dev)

    def close(self) -> None:
        self.inputs.close(), self.outputs.close()


def measure_stage(attend, ref: SourceAttention, norm1, stream: RowStore, stat: ErrorStat, dev: str,
                  post1=lambda y: y) -> float:
    """A stage's attention error on the source's inputs; its own stream gets its attention residual
    (the MLP half of the layer follows for every stream together)."""
    errs = []
    for lo, x_src, y_src in ref.blocks(dev):
        errs.append(relative_errors(attend(x_src), y_src))
        h = stream.read(lo, lo + ROW_BATCH).to(dev)
        stream.write(lo, h + post1(attend(norm1(h))))
    e = torch.cat(errs)
    stat.add(e)
    return float(e.mean())


def measure_streams(src: Source, streams: dict[str, RowStore], stages, held_out: torch.Tensor,
                    final_norm: torch.Tensor, head_name: str, dev: str) -> tuple[float, dict]:
    """The source's held-out perplexity and every stage's logits error / KL / perplexity against it,
    from the final hidden states of the streams (closed here: nothing reads them after)."""
    finals = {k: final_hidden(src, store.all().to(dev), final_norm) for k, store in streams.items()}
    for store in streams.values():
        store.close()
    targets = held_out[:, 1:].reshape(-1).to(dev)
    return_freed_memory(trim=True)
    return logits_metrics(finals["source"], {k: finals[k] for k in stages}, targets,
                          lambda: head_chunks(src.ckpt, head_name, dev), final_softcap(src))
