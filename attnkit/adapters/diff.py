"""DIFF retrofit (differential attention, Ye et al. 2025) in a function-preserving form.

Per head h, with A1 = softmax(Q·Kᵀ/√d) (the source head, untouched) and A2 = softmax(Q2·Kᵀ/√d):

    O   = A1·V − r·λ·(A2·V)                        λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init(l)
    out = (1 − r)·O + r·(1 − λ_init)·RMSNorm(O)·w_h

r is the schedule ramp (0 → 1 over the first `anneal_fraction` of fine-tuning, `attnkit_set_step`).
At r = 0 both terms vanish exactly, so the converted model is the source model.

Departures from the paper, on purpose:
* The second map is *doubled*, not split: Q2 is a new projection (`diff_q_proj`, zero-initialised,
  so A2 starts as the uniform causal average, the "common-mode" the subtraction should cancel) and
  it attends to the *same* keys K. Splitting Q/K into halves would change A1 (not function
  preserving); a separate K2 would grow the KV cache. Sharing K keeps the cache byte-for-byte as the
  source's (and keeps MLA's latent cache valid).
* Heads are not paired (the paper halves the head count and doubles V per head); every source
  head keeps its V and its o_proj columns.
* The per-head RMSNorm (`w_h`, initialised from calibration so that its output has the head's
  measured RMS) and the λ term are blended in by the same ramp instead of being present from step 0.

This file is copied next to converted checkpoints (trust_remote_code): it imports only torch.
"""

from __future__ import annotations

import torch
from torch import nn

from .dex import Annealed


class DiffCombine(Annealed):
    """Combines the two attention outputs of one layer, [B, T, H, d_v] each."""

    def __init__(self, num_heads: int, head_dim: int, layer_idx: int, anneal_fraction: float = 0.25, eps: float = 1e-6):
        super().__init__()
        gen = torch.Generator().manual_seed(1000 + layer_idx)
        # λ reparameterisation as in the paper: vectors of the head dim, N(0, 0.1)
        self.lambda_q1 = nn.Parameter(torch.randn(head_dim, generator=gen) * 0.1)
        self.lambda_k1 = nn.Parameter(torch.randn(head_dim, generator=gen) * 0.1)
        self.lambda_q2 = nn.Parameter(torch.randn(head_dim, generator=gen) * 0.1)
        self.lambda_k2 = nn.Parameter(torch.randn(head_dim, generator=gen) * 0.1)
        self.norm_weight = nn.Parameter(torch.ones(num_heads, head_dim))  # per-head RMSNorm weight [H, d_v]
        self.eps = eps
        self._register_schedule(layer_idx, anneal_fraction)

    def full_lambda(self) -> torch.Tensor:
        lam1 = torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1))
        lam2 = torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2))
        return lam1 - lam2 + self.lambda_init

    def forward(self, out1: torch.Tensor, out2: torch.Tensor) -> torch.Tensor:
        # out1 = A1·V, out2 = A2·V: [B, T, H, d_v]
        r = self.ramp.to(out1.dtype)
        diff = out1 - (r * self.full_lambda().to(out1.dtype)) * out2
        rms = torch.rsqrt(diff.float().pow(2).mean(-1, keepdim=True) + self.eps).to(diff.dtype)
        normed = diff * rms * self.norm_weight.to(diff.dtype) * (1.0 - self.lambda_init.to(diff.dtype))
        return (1.0 - r) * diff + r * normed

    def extra_repr(self) -> str:
        return f"lambda_init={float(self.lambda_init):.3f}"
