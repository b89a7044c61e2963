"""Step-driven schedules: the learning rate (warmup + cosine / WSD) and the step broadcast that
DEX/DIFF modules read for their λ annealing.

Both are pure functions of (step, total_steps), so a resumed run lands on exactly the same values.
"""

from __future__ import annotations

import math
from functools import partial

import torch


def broadcast_step(model: torch.nn.Module, step: int, total_steps: int) -> int:
    """Call `attnkit_set_step(step, total_steps)` on every submodule that defines it; return how many."""
    count = 0
    for module in model.modules():
        setter = getattr(module, "attnkit_set_step", None)
        if callable(setter):
            setter(int(step), int(total_steps))
            count += 1
    return count


def lr_multiplier(
    step: int,
    total_steps: int,
    warmup_steps: int,
    kind: str = "cosine",
    min_ratio: float = 0.1,
    decay_fraction: float = 0.2,
) -> float:
    """Factor on the peak LR for optimizer step `step` (0-based).

    warmup: linear (step+1)/warmup; then
    cosine:   min + (1-min)·½(1+cos(π·progress)) over the remaining steps;
    wsd:      1 (stable) until the last `decay_fraction` of steps, then linear to `min_ratio`;
    constant: 1.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if kind == "wsd":
        decay_steps = max(1, round(decay_fraction * total_steps))
        decay_start = max(warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        return 1.0 - (1.0 - min_ratio) * progress
    raise ValueError(f"unknown schedule {kind!r}")


def build_scheduler(optimizer, total_steps: int, warmup_steps: int, kind: str, min_ratio: float, decay_fraction: float):
    """A LambdaLR over `lr_multiplier`; its state_dict is just the step count, so resume is exact."""
    fn = partial(
        lr_multiplier,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        kind=kind,
        min_ratio=min_ratio,
        decay_fraction=decay_fraction,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
