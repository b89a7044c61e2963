"""Running a streamed conversion's held-out text through the source and through each step of the
conversion, layer by layer, and comparing them (the per-step report of `convert --to mla` and
`--to gqa`); and handing a layer's freed memory back to the OS between layers."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from attnkit.converters.mla.metrics import ErrorStat, logits_metrics, relative_errors
from attnkit.converters.mla.source import ROW_BATCH, Source, final_hidden, final_softcap, head_chunks
from attnkit.converters.stream.rowstore import RowStore


MMAP_THRESHOLD = 1 << 20  # bytes: larger blocks are mmapped, so freeing them returns them to the OS


@functools.cache
def _libc():
    """glibc's malloc controls, or None where there are none (another libc, another OS)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def _mallopt_mmap_threshold(nbytes: int) -> None:
    """glibc's M_MMAP_THRESHOLD, and its M_TRIM_THRESHOLD at twice that, as glibc's own dynamic policy
    pairs them (setting one by hand otherwise leaves the heap's top trimmed at 128 KiB: every free
    there hands pages back that the next allocation faults in again)."""
    if (libc := _libc()) is not None:
        libc.mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 2 * nbytes)  # M_TRIM_THRESHOLD


def _malloc_trim() -> None:
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)


def return_freed_memory(trim: bool = False) -> None:
    """Large tensors freed by one layer go back to the OS (glibc otherwise keeps them in its heap):
    a fixed 1 MiB mmap threshold (glibc's own grows with what is freed, up to 32 MiB); `trim` also
    hands back the free pages inside the heap (what tokenising the calibration text and a layer's
    small tensors leave behind)."""
    _mallopt_mmap_threshold(MMAP_THRESHOLD)
    if trim:
        _malloc_trim()


def end_conversion_memory_policy() -> None:
    """After a conversion in a process that goes on (`convert --eval`): a 32 MiB threshold, what glibc's
    own dynamic one grows to, so that the evaluation's forward passes reuse heap blocks instead of
    faulting in fresh mmapped pages for every MB-sized activation, as they would under the 1 MiB one."""
    _mallopt_mmap_threshold(32 << 20)
    _malloc_trim()


HEAP_REUSE_MAX = 2 << 20  # bytes: `heap_reuse` keeps temporaries under this in the heap (the fit then
# fragments it by ~95 of them: at most ~0.19 GB)


@contextmanager
def heap_reuse(block_bytes: int) -> Iterator[None]:
    """Temporaries of up to `block_bytes` come from (and go back to) the heap inside the block; after
    it the 1 MiB threshold returns and the heap is trimmed. Why: an iterative fit on small tensors
    (the engine form's steady latent mix: hundreds of L-BFGS steps on [16384, 29] temporaries at
    the reference's size) pays a fresh mmap and its page faults for each under the 1 MiB threshold:
    9.7 s vs 6.2 s over the reference's 4 layers. The heap's fragmentation costs ~95 blocks for a
    moment (the reference's 1.8 MiB: ~170 MB; a 1B-wide layer's 4 MiB at 8,192 calibration tokens:
    +395 MB, 16 % of that checkpoint, its MLA step's peak), so from HEAP_REUSE_MAX on — a model whose
    fit does far more arithmetic per temporary than its page faults cost — nothing changes."""
    reuse = block_bytes < HEAP_REUSE_MAX
    if reuse:
        _mallopt_mmap_threshold(2 * block_bytes)
    try:
        yield
    finally:
        if reuse:
            return_freed_memory(trim=True)




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
    hidden = {k: store.all() for k, store in streams.items()}
    for store in streams.values():
        store.close()
    return final_metrics(src, hidden, stages, held_out, final_norm, head_name, dev)


def final_metrics(src: Source, hidden: dict[str, torch.Tensor], stages, held_out: torch.Tensor,
                  final_norm: torch.Tensor, head_name: str, dev: str) -> tuple[float, dict]:
    """The same from final hidden states in memory ({"source": [N, T, D], stage: [N, T, D]}; each is
    freed once normed): the final norm, the head (read in chunks, softcapped as the source does) and the
    next-token targets of `held_out` [N, T]."""
    finals = {k: final_hidden(src, hidden.pop(k).to(dev), final_norm) for k in list(hidden)}
    targets = held_out[:, 1:].reshape(-1).to(dev)
    return_freed_memory(trim=True)
    return logits_metrics(finals["source"], {k: finals[k] for k in stages}, targets,
                          lambda: head_chunks(src.ckpt, head_name, dev), final_softcap(src))
