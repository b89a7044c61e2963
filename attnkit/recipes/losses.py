"""Healing losses: next-token cross-entropy and KL distillation from the source (teacher) model."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_ce(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from positions ≤ t.  logits [B, L, V], ids [B, L]."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), input_ids[:, 1:].reshape(-1))


def distill_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher ‖ student) per position at temperature T, averaged over positions, times T².

    T² keeps the gradient scale independent of T (Hinton et al. 2015). logits [B, L, V].
    """
    vocab = student_logits.shape[-1]
    s = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)  # [B·L, V]
    t = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    kl = F.kl_div(s, t, log_target=True, reduction="batchmean")  # sum over V, mean over B·L
    return kl * temperature**2


def heal_loss(
    student_logits: torch.Tensor,
    input_ids: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    ce_weight: float,
    kl_weight: float,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ce_weight·CE + kl_weight·KL; returns the total and its parts (floats, for logging)."""
    parts: dict[str, torch.Tensor] = {}
    total = student_logits.new_zeros((), dtype=torch.float32)
    if ce_weight > 0:
        parts["ce"] = next_token_ce(student_logits, input_ids)
        total = total + ce_weight * parts["ce"]
    if kl_weight > 0:
        if teacher_logits is None:
            raise ValueError("kl_weight > 0 needs teacher logits")
        parts["kl"] = distill_kl(student_logits, teacher_logits, temperature)
        total = total + kl_weight * parts["kl"]
    return total, {k: float(v.detach()) for k, v in parts.items()}
