"""Error measures for the MLA report: attention-output error per layer and, from the final
hidden states, logits error, KL(source || converted) and perplexity, computed over the
vocabulary in chunks so a 128k-token head never has to be materialised at once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

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


def _zeros(n: int, value: float = 0.0) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.float64)


@dataclass
class _Source:
    """Streaming softmax statistics of the source's logits a, per token (shared by every stage)."""

    m: torch.Tensor
    z: torch.Tensor
    sq: torch.Tensor
    tgt: torch.Tensor

    @classmethod
    def new(cls, n: int) -> "_Source":
        return cls(_zeros(n, -float("inf")), _zeros(n), _zeros(n), _zeros(n))


@dataclass
class _Stage:
    """Streaming statistics of one stage's logits b against the source's a, per token."""

    y: torch.Tensor  # sum exp(a - m_a) (a - b)
    m_b: torch.Tensor
    z_b: torch.Tensor
    sq_diff: torch.Tensor
    tgt_b: torch.Tensor

    @classmethod
    def new(cls, n: int) -> "_Stage":
        return cls(_zeros(n), _zeros(n, -float("inf")), _zeros(n), _zeros(n), _zeros(n))


def _target_logit(old: torch.Tensor, x: torch.Tensor, targets: torch.Tensor, lo: int) -> torch.Tensor:
    inside = (targets >= lo) & (targets < lo + x.shape[1])
    idx = (targets - lo).clamp(0, x.shape[1] - 1)[:, None]
    return torch.where(inside, x.gather(1, idx)[:, 0], old)


def logits_metrics(source: torch.Tensor, others: dict[str, torch.Tensor], targets: torch.Tensor,
                   head_chunks: Callable[[], Iterator[tuple[int, torch.Tensor]]],
                   softcap: float | None = None) -> tuple[float, dict[str, dict]]:
    """Compare final normed hidden states [N, D] of each model in `others` with `source`.

    `head_chunks()` yields (first_row, lm_head rows [V_chunk, D]). Returns the source perplexity and,
    per model: logits_rel_err_mean/max, kl (mean nats/token) and ppl. The source's running softmax is
    computed once per vocabulary chunk and shared by every model compared with it. `softcap`: the
    model's final-logit softcapping (logits = cap * tanh(logits / cap), Gemma), applied to every model.
    """
    cap = (lambda z: z) if not softcap else (lambda z: torch.tanh(z / softcap).mul_(softcap))  # noqa: E731
    n = source.shape[0]
    src, runs = _Source.new(n), {k: _Stage.new(n) for k in others}
    for lo, w in head_chunks():
        step = max(64, (1 << 21) // max(1, n))  # bound the [tokens, rows] fp64 temporaries to ~16 MB
        for sub in range(0, w.shape[0], step):
            ws = w[sub : sub + step].float()  # upcast a sub-block, not the chunk: a 1B head's 8,192 rows are 64 MB in fp32
            a = cap((source.float() @ ws.T).double())
            new_m = torch.maximum(src.m, a.max(dim=1).values)
            keep = torch.exp(src.m - new_m)
            ea = torch.exp(a - new_m[:, None])
            for k, h in others.items():
                r, b = runs[k], cap((h.float() @ ws.T).double())
                r.tgt_b = _target_logit(r.tgt_b, b, targets, lo + sub)
                diff = a - b
                r.y = r.y * keep + torch.linalg.vecdot(ea, diff)
                r.sq_diff += torch.linalg.vecdot(diff, diff)
                new_mb = torch.maximum(r.m_b, b.max(dim=1).values)
                r.z_b = r.z_b * torch.exp(r.m_b - new_mb) + b.sub_(new_mb[:, None]).exp_().sum(1)  # b is spent
                r.m_b = new_mb
            src.z = src.z * keep + ea.sum(1)
            src.m = new_m
            src.sq += torch.linalg.vecdot(a, a)
            src.tgt = _target_logit(src.tgt, a, targets, lo + sub)
    lse_a = src.m + src.z.log()
    src_ppl = float(torch.exp((lse_a - src.tgt).mean()))
    results = {}
    for k, r in runs.items():
        lse_b = r.m_b + r.z_b.log()
        kl = r.y / src.z - lse_a + lse_b
        rel = (r.sq_diff / src.sq.clamp_min(1e-30)).sqrt()
        results[k] = {
            "logits_rel_err_mean": float(rel.mean()),
            "logits_rel_err_max": float(rel.max()),
            "kl": float(kl.mean().clamp_min(0)),
            "ppl": float(torch.exp((lse_b - r.tgt_b).mean())),
        }
    return src_ppl, results
