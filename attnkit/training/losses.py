"""Healing losses: next-token cross-entropy and KL distillation from the source (teacher) model.

The teacher arrives either as logits (run in the same process) or as `TeacherTargets` read from a
teacher cache (attnkit/training/teacher_cache.py): log-probs at temperature T over the whole
vocabulary, or the top-k log-probs with their token ids plus the log of the mass outside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TeacherTargets:
    """Teacher log-probs at temperature T for a batch of rows.

    full:  logprobs [B, L, V], ids None, rest None
    top-k: logprobs [B, L, k], ids [B, L, k] (int), rest [B, L] = log(1 − Σ top-k probs)
    """

    logprobs: torch.Tensor
    ids: torch.Tensor | None = None
    rest: torch.Tensor | None = None

    def to(self, device) -> "TeacherTargets":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return TeacherTargets(move(self.logprobs), move(self.ids), move(self.rest))


def next_token_ce(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from positions ≤ t.  logits [B, L, V], ids [B, L]."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), input_ids[:, 1:].reshape(-1))


def _kl_rows(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Σ_v p (log p − log q), averaged over rows.  both [N, V] log-probs."""
    return F.kl_div(student_logp, teacher_logp, log_target=True, reduction="batchmean")


def distill_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher ‖ student) per position at temperature T, averaged over positions, times T².

    T² keeps the gradient scale independent of T (Hinton et al. 2015). logits [B, L, V].
    """
    vocab = teacher_logits.shape[-1]
    t = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / temperature, dim=-1)  # [B·L, V]
    return distill_kl_targets(student_logits, TeacherTargets(t), temperature)


def distill_kl_targets(student_logits: torch.Tensor, targets: TeacherTargets, temperature: float = 1.0) -> torch.Tensor:
    """T² · KL(teacher ‖ student) from cached teacher log-probs (full, or top-k + one "rest" bucket).

    Top-k: the distributions are compared on k + 1 outcomes — the teacher's k tokens and everything
    else — so KL = Σ_k p_k (log p_k − log q_k) + p_rest (log p_rest − log q_rest), with
    q_rest = the student's mass outside the teacher's k ids. This is a lower bound of the full KL
    (coarse-graining never increases KL) and equals it when the teacher's rest mass is 0.
    """
    vocab = student_logits.shape[-1]
    s = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)  # [N, V]
    if targets.ids is None:
        return _kl_rows(s, targets.logprobs.float().reshape(-1, vocab)) * temperature**2
    k = targets.ids.shape[-1]
    ids = targets.ids.reshape(-1, k).long()  # [N, k]
    t_top = targets.logprobs.float().reshape(-1, k)  # [N, k]
    s_top = s.gather(-1, ids)  # [N, k]
    kl = (t_top.exp() * (t_top - s_top)).sum(-1)  # [N]
    if k < vocab:  # the rest bucket: all tokens outside the teacher's top-k
        t_rest = targets.rest.float().reshape(-1)  # [N]
        s_rest = torch.logsumexp(s.scatter(-1, ids, float("-inf")), dim=-1)  # [N] log(1 − Σ_k q)
        p_rest = t_rest.exp()
        kl = kl + torch.where(p_rest > 0, p_rest * (t_rest - s_rest), torch.zeros_like(p_rest))
    return kl.mean() * temperature**2


def topk_targets(teacher_logits: torch.Tensor, temperature: float, top_k: int | None) -> TeacherTargets:
    """What a teacher cache stores for logits [B, L, V]: full log-probs, or top-k + ids + log rest mass."""
    logp = F.log_softmax(teacher_logits.float() / temperature, dim=-1)  # [B, L, V]
    if top_k is None or top_k >= logp.shape[-1]:
        return TeacherTargets(logp)
    top, ids = logp.topk(top_k, dim=-1)  # [B, L, k]
    rest = torch.logsumexp(logp.scatter(-1, ids, float("-inf")), dim=-1)  # [B, L], exact (not 1 − Σ)
    return TeacherTargets(top, ids.to(torch.int32), rest)


def hidden_mse(student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean over layers and positions of ‖h_s − h_t‖² / ‖h_t‖², hidden states [B, L, D] per layer.

    Per-position normalisation, because a few positions (the first token) carry hidden states
    orders of magnitude larger than the rest and would own an unnormalised MSE. Logit KL gives
    the attention of layer 3 a signal only through 20 more layers; this gives each layer its own.
    """
    if len(student) != len(teacher):
        raise ValueError(f"{len(student)} student hidden states vs {len(teacher)} teacher's: not the same depth")
    per_layer = []
    for s, t in zip(student, teacher):
        t = t.float()
        err = (s.float() - t).pow(2).sum(-1)  # [B, L]
        per_layer.append((err / t.pow(2).sum(-1).clamp_min(1e-6)).mean())
    return torch.stack(per_layer).mean()


def heal_loss(
    student_logits: torch.Tensor,
    input_ids: torch.Tensor,
    teacher: torch.Tensor | TeacherTargets | None,
    ce_weight: float,
    kl_weight: float,
    temperature: float,
    hidden_weight: float = 0.0,
    hidden: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
    ce: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ce_weight·CE + kl_weight·KL + hidden_weight·hidden MSE; `teacher` is logits [B, L, V] or
    cached targets, `hidden` the (student, teacher) layer outputs, `ce` the cross-entropy when computed
    without whole logits (`chunked_head`). Returns total and parts."""
    parts: dict[str, torch.Tensor] = {}
    total = student_logits.new_zeros((), dtype=torch.float32)
    if ce_weight > 0:
        parts["ce"] = next_token_ce(student_logits, input_ids) if ce is None else ce
        total = total + ce_weight * parts["ce"]
    if kl_weight > 0:
        if teacher is None:
            raise ValueError("kl_weight > 0 needs teacher logits")
        if isinstance(teacher, TeacherTargets):
            parts["kl"] = distill_kl_targets(student_logits, teacher, temperature)
        else:
            parts["kl"] = distill_kl(student_logits, teacher, temperature)
        total = total + kl_weight * parts["kl"]
    if hidden_weight > 0:
        if hidden is None:
            raise ValueError("hidden_weight > 0 needs the student's and the teacher's hidden states")
        parts["hidden"] = hidden_mse(*hidden)
        total = total + hidden_weight * parts["hidden"]
    return total, {k: float(v.detach()) for k, v in parts.items()}
