"""`--fit-steps N`: each written attention layer fitted by gradient to the source layer's output.

The closed-form steps (RoPE reduction, PCA latent, query refit) each solve a linear stand-in for the
attention: the softmax, the latent RMSNorm and the interplay of q, k and v are not in their
objective. This step takes the layer exactly as it is written (the DeepSeek-V3 or attnkit module,
every weight of it, o_proj included) and minimises what matters, the relative squared error of its
output against the source attention's output, on the calibration rows: the source's own hidden states
in, the source's attention output as the target (layer by layer, "teacher-forced"), Adam with a
cosine schedule. Resident: one layer's attention with its gradients and Adam state, one batch of rows,
and one chunk of rows' activations (a wide layer takes a step's rows one at a time, their gradients summed).

It is lossy-improving, never exact-preserving, so it never runs on a layer that is already exact
(a first batch error below `EXACT_REL_ERR`: Adam's normalised steps would move weights whose
gradient is only rounding noise), and it keeps the starting weights when the fit ends worse on the
calibration rows than it began.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnkit.converters.stream.rowstore import RowStore
from attnkit.training.schedules import lr_multiplier

ROWS_PER_STEP = 4  # calibration rows per optimizer step (4 x 1024 tokens at the default --calib-seq-len with the fit)
CHUNK_VALUES = 1 << 21  # hidden values (rows x T x D) through the layer at once: 1 row of 1,024 x 2,048 (1B shape)
EXACT_REL_ERR = 1e-6  # a layer this close to the source is exact already: not fitted
WARMUP = 0.05  # of the steps, linear warm-up before the cosine decay


@dataclass
class FitResult:
    """The report's per-layer record: relative squared error on the calibration rows, before and after."""

    steps: int
    rel_err_before: float
    rel_err_after: float
    kept: str  # "fitted" | "start" (the fit ended worse) | "exact" (not fitted)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "rel_err_before": round(self.rel_err_before, 6),
                "rel_err_after": round(self.rel_err_after, 6), "kept": self.kept}


def rel_err(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """sum |out - target|^2 / sum |target|^2 over the batch: scale-free, one number per batch."""
    return (out - target).pow(2).sum() / target.pow(2).sum().clamp_min(1e-30)


def lr_at(step: int, steps: int, lr: float) -> float:
    """The healing runs' schedule (`lr_multiplier`): linear warm-up over WARMUP of the steps, then cosine
    decay to zero."""
    return lr * lr_multiplier(step, steps, max(1, int(steps * WARMUP)), "cosine", min_ratio=0.0)


def _batches(rows: RowStore, per_step: int) -> Callable[[int], torch.Tensor]:
    """Step k's calibration rows [B, T, D], cycling through the store in order."""
    n = rows.rows
    per_step = min(per_step, n)

    def batch(k: int) -> torch.Tensor:
        lo = (k * per_step) % n
        hi = lo + per_step
        return rows.read(lo, hi) if hi <= n else torch.cat([rows.read(lo, n), rows.read(0, hi - n)])
    return batch


def row_chunks(x: torch.Tensor) -> list[slice]:
    """The batch [B, T, D] in runs of rows holding at most CHUNK_VALUES hidden values together (at least one
    row): a small layer takes the whole batch at once, a wide one a row at a time."""
    per = max(1, CHUNK_VALUES // (x.shape[1] * x.shape[2]))
    return [slice(i, i + per) for i in range(0, x.shape[0], per)]


def by_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn over a batch [B, T, D] a chunk of rows at a time (`row_chunks`; no autograd)."""
    return torch.cat([fn(x[c]) for c in row_chunks(x)])


def backward_by_rows(attend: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, target: torch.Tensor) -> None:
    """Accumulate the gradient of rel_err(attend(x), target) over the batch a chunk of rows at a time.

    The error's denominator is the whole batch's, so the chunks' terms add up to the batch error and their
    gradients to its gradient (up to the order of the sums; one chunk is the batch's own computation). What
    autograd keeps for the backward is one chunk's activations: the layer's projections, RoPE products and
    attention outputs (about 0.7 GB for one 1,024-token row of the Llama-3.1-8B shape; docs/memory.md)."""
    denom = target.pow(2).sum().clamp_min(1e-30)
    with torch.enable_grad():  # the converter runs under no_grad
        for c in row_chunks(x):  # x, target [B, T, D]
            ((attend(x[c]) - target[c]).pow(2).sum() / denom).backward()


def _mean_error(student: Callable, teacher: Callable, inputs: Callable[[int], torch.Tensor], count: int) -> float:
    total = 0.0
    with torch.no_grad():
        for k in range(count):
            x = inputs(k)  # read and normalised once for both
            total += float(rel_err(by_rows(student, x), by_rows(teacher, x)))
    return total / count


def fit_attention(module: torch.nn.Module, attend: Callable[[torch.Tensor], torch.Tensor],
                  source: Callable[[torch.Tensor], torch.Tensor], attn_input: Callable[[torch.Tensor], torch.Tensor],
                  rows: RowStore, steps: int, lr: float, dev: str,
                  start: dict[str, torch.Tensor] | None = None) -> FitResult:
    """Fit `module`'s parameters in place so that attend(x) follows source(x) on the calibration rows.

    attend / source: the written and the source attention, x [B, T, D] -> [B, T, D]; attn_input maps a
    batch of residual-stream rows to x (the layer's input norm). The error before and after is the
    mean over the first ROWS_PER_STEP-row batches that cover the rows once (at most 8 of them).
    start: the tensors the module was loaded from, by parameter name (any float dtype that holds them
    exactly, e.g. the bf16 tensors about to be written); restored from when the fit ends worse. Without
    it the starting weights are copied first, one more fp32 copy of the layer's attention."""
    batch = _batches(rows, ROWS_PER_STEP)
    inputs = lambda k: attn_input(batch(k).to(dev))  # noqa: E731
    check = min(8, max(1, math.ceil(rows.rows / ROWS_PER_STEP)))
    before = _mean_error(attend, source, inputs, check)
    if before < EXACT_REL_ERR:
        return FitResult(0, before, before, "exact")
    if start is None:
        start = {n: p.detach().clone() for n, p in module.named_parameters()}
    params = [p for p in module.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    for k in range(steps):
        with torch.no_grad():
            x = inputs(k)
            target = by_rows(source, x)
        for group in opt.param_groups:
            group["lr"] = lr_at(k, steps, lr)
        opt.zero_grad(set_to_none=True)
        backward_by_rows(attend, x, target)
        opt.step()
    for p in params:
        p.requires_grad_(False)
    del opt
    after = _mean_error(attend, source, inputs, check)
    if after >= before:  # never write a layer the fit made worse
        with torch.no_grad():
            for n, p in module.named_parameters():
                p.copy_(start[n])
        return FitResult(steps, before, before, "start")
    return FitResult(steps, before, after, "fitted")
