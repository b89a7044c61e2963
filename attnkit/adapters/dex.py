"""DEX (differential extension, Kong, Jang & Kwak 2025): `O_h ← O_h − λ·f_D(O_h)` on selected heads.

`O_h` is a head's attention output (softmax(QKᵀ/√d)·V, the slice of the `o_proj` input that
belongs to head h). `f_D` is one learnable d×d linear map per layer, shared by that layer's
selected heads. λ = ramp · (λ_init(l) + λ_learned): `ramp` goes 0 → 1 over the first
`anneal_fraction` of fine-tuning (driven by `attnkit_set_step`), λ_init(l) is the DIFF
Transformer's depth schedule, λ_learned starts at 0. At conversion ramp = 0 *and* f_D = 0, so the
converted model computes exactly what the source computed.

This file is copied next to converted checkpoints (trust_remote_code): it imports only torch.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def lambda_init_for_layer(layer_idx: int) -> float:
    """DIFF Transformer depth schedule λ_init = 0.8 − 0.6·exp(−0.3·(l−1)), l = layer_idx + 1."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def anneal_ramp(step: int, total_steps: int, anneal_fraction: float) -> float:
    """Linear ramp 0 → 1 over the first `anneal_fraction` of `total_steps` (1 afterwards)."""
    span = max(1.0, anneal_fraction * max(total_steps, 1))
    return float(min(1.0, max(0.0, step / span)))


class Annealed(nn.Module):
    """Holds the schedule state that `attnkit_set_step` drives (persistent buffers, saved with the model)."""

    def _register_schedule(self, layer_idx: int, anneal_fraction: float) -> None:
        self.register_buffer("lambda_init", torch.tensor([lambda_init_for_layer(layer_idx)]))
        self.register_buffer("ramp", torch.zeros(1))
        self.register_buffer("anneal_fraction", torch.tensor([float(anneal_fraction)]))

    def attnkit_set_step(self, step: int, total_steps: int) -> None:
        self.ramp.fill_(anneal_ramp(step, total_steps, float(self.anneal_fraction)))


class DexHeadMix(Annealed):
    """The DEX operation of one layer, on the per-head attention output [B, T, H, d_v]."""

    def __init__(self, num_heads: int, head_dim: int, selected: list[int], layer_idx: int, anneal_fraction: float = 0.25):
        super().__init__()
        mask = torch.zeros(num_heads)
        mask[list(selected)] = 1.0
        self.f_d = nn.Linear(head_dim, head_dim, bias=False)
        nn.init.zeros_(self.f_d.weight)  # f_D = 0: exact at any λ until it learns
        self.lambda_learned = nn.Parameter(torch.zeros(1))
        # buffers are persistent: a fine-tuned checkpoint keeps its ramp, selection and schedule
        self.register_buffer("head_mask", mask)  # [H] 1 = selected
        self._register_schedule(layer_idx, anneal_fraction)

    def effective_lambda(self) -> torch.Tensor:
        return self.ramp * (self.lambda_init + self.lambda_learned)

    def forward(self, out: torch.Tensor) -> torch.Tensor:
        # out: [B, T, H, d_v]; weight per head [H, 1] = λ on selected heads, 0 elsewhere
        weight = (self.effective_lambda() * self.head_mask).to(out.dtype).view(-1, 1)
        return out - weight * self.f_d(out)

    def extra_repr(self) -> str:
        return f"selected={int(self.head_mask.sum())}/{self.head_mask.numel()}, lambda_init={float(self.lambda_init):.3f}"
