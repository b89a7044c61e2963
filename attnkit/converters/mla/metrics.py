"""Error measures for the MLA report: attention-output error per layer and, from the final
hidden states, logits error, KL(source || converted) and perplexity, computed over the
vocabulary in chunks so a 128k-token head never has to be materialised at once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch


def relative_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token |out - ref| / |ref| over the last dim, flattened."""
    diff = (out.float() - ref.float()).flatten(0, -2).norm(dim=-1)
    return diff / ref.float().flatten(0, -2).norm(dim=-1).clamp_min(1e-30)


@dataclass
class ErrorStat:
    """Mean and max of per-token relative errors, accumulated over batches and layers."""

    total: float = 0.0
    count: int = 0
    max: float = 0.0

    def add(self, errs: torch.Tensor) -> None:
        self.total += float(errs.double().sum())
        self.count += errs.numel()
        self.max = max(self.max, float(errs.max()))

    @property
    def mean(self) -> float:
        return self.total / max(1, self.count)


@dataclass
class _Running:
    """Streaming softmax statistics of logits b against the source's a, per token."""

    m_a: torch.Tensor
    z_a: torch.Tensor
    m_b: torch.Tensor
    z_b: torch.Tensor
    y: torch.Tensor  # sum exp(a - m_a) (a - b)
    sq_diff: torch.Tensor
    sq_a: torch.Tensor
    tgt_b: torch.Tensor
    tgt_a: torch.Tensor = field(default=None)

    @classmethod
    def new(cls, n: int) -> "_Running":
        z = lambda v: torch.full((n,), v, dtype=torch.float64)  # noqa: E731
        return cls(z(-float("inf")), z(0.0), z(-float("inf")), z(0.0), z(0.0), z(0.0), z(0.0), z(0.0), z(0.0))


def _update(r: _Running, a: torch.Tensor, b: torch.Tensor, targets: torch.Tensor, lo: int) -> None:
    a, b = a.double(), b.double()
    new_ma = torch.maximum(r.m_a, a.max(dim=1).values)
    keep = torch.exp(r.m_a - new_ma)
    ea = torch.exp(a - new_ma[:, None])
    r.z_a = r.z_a * keep + ea.sum(1)
    r.y = r.y * keep + (ea * (a - b)).sum(1)
    r.m_a = new_ma
    new_mb = torch.maximum(r.m_b, b.max(dim=1).values)
    r.z_b = r.z_b * torch.exp(r.m_b - new_mb) + torch.exp(b - new_mb[:, None]).sum(1)
    r.m_b = new_mb
    r.sq_diff += ((a - b) ** 2).sum(1)
    r.sq_a += (a**2).sum(1)
    inside = (targets >= lo) & (targets < lo + a.shape[1])
    idx = (targets - lo).clamp(0, a.shape[1] - 1)[:, None]
    r.tgt_a = torch.where(inside, a.gather(1, idx)[:, 0], r.tgt_a)
    r.tgt_b = torch.where(inside, b.gather(1, idx)[:, 0], r.tgt_b)


def logits_metrics(source: torch.Tensor, others: dict[str, torch.Tensor], targets: torch.Tensor,
                   head_chunks: Callable[[], Iterator[tuple[int, torch.Tensor]]]) -> tuple[float, dict[str, dict]]:
    """Compare final normed hidden states [N, D] of each model in `others` with `source`.

    `head_chunks()` yields (first_row, lm_head rows [V_chunk, D]). Returns the source perplexity and,
    per model: logits_rel_err_mean/max, kl (mean nats/token) and ppl.
    """
    n = source.shape[0]
    runs = {k: _Running.new(n) for k in others}
    for lo, w in head_chunks():
        w = w.float()
        step = max(64, (1 << 21) // max(1, n))  # bound the [tokens, rows] fp64 temporaries to ~16 MB
        for sub in range(0, w.shape[0], step):
            ws = w[sub : sub + step]
            a = source.float() @ ws.T
            for k, h in others.items():
                _update(runs[k], a, h.float() @ ws.T, targets, lo + sub)
    results, src_ppl = {}, None
    for k, r in runs.items():
        lse_a, lse_b = r.m_a + r.z_a.log(), r.m_b + r.z_b.log()
        kl = r.y / r.z_a - lse_a + lse_b
        rel = (r.sq_diff / r.sq_a.clamp_min(1e-30)).sqrt()
        src_ppl = float(torch.exp((lse_a - r.tgt_a).mean()))
        results[k] = {
            "logits_rel_err_mean": float(rel.mean()),
            "logits_rel_err_max": float(rel.max()),
            "kl": float(kl.mean().clamp_min(0)),
            "ppl": float(torch.exp((lse_b - r.tgt_b).mean())),
        }
    return src_ppl, results
