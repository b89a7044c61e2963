"""DEX conversion math: head scores from calibration attention, head selection, the new config.

The selection rule (`--heads auto`, documented in docs/dex.md): per layer, score every head by
its *normalised attention entropy* on calibration text — for query position t the entropy of its
attention row divided by log(t + 1), the entropy of a uniform row over the t + 1 visible keys,
averaged over positions t ≥ 1 and sequences. 1 = the head spreads attention evenly (the diffuse,
"noisy" attention the differential operation is meant to sharpen), 0 = it attends to one key.
The ceil(fraction·H) heads with the highest score in each layer are selected (ties: lower index).
`--heads all` selects every head; `--heads FRACTION` is `auto` with that fraction.
"""

from __future__ import annotations

import math

import torch

from attnkit.adapters.dex import lambda_init_for_layer
from attnkit.errors import AttnkitError

HEAD_RULES = ("auto", "all")


def parse_heads(heads: str, heads_fraction: float) -> tuple[str, float]:
    """`--heads` + `--heads-fraction` → (rule, fraction); one-line errors for anything else."""
    text = str(heads).strip().lower()
    if text == "all":
        return "all", 1.0
    if text == "auto":
        rule, fraction = "auto", heads_fraction
    else:
        try:
            fraction = float(text)
        except ValueError:
            raise AttnkitError(f"unknown head-selection rule {heads!r} (expected auto, all or a fraction in (0, 1])") from None
        rule = "auto"
    if not (isinstance(fraction, (int, float)) and math.isfinite(fraction) and 0.0 < fraction <= 1.0):
        raise AttnkitError(f"head fraction must be in (0, 1], got {fraction}")
    return rule, float(fraction)


def normalized_entropy(weights: torch.Tensor, first_query: int | None = None) -> tuple[torch.Tensor, int]:
    """Per-head normalised entropy summed over positions ≥ 1, and the count of those positions.

    weights: [B, H, T, S] causal attention probabilities of T consecutive queries; query j of the
    block is key `first_query + j` and sees keys 0 .. first_query + j (default S - T: the last T keys
    are the T queries, a whole sequence). Returns (sum [H], count int) so that batches and blocks of
    query rows can be accumulated before dividing.
    """
    bsz, heads, t_len, s_len = weights.shape
    first = s_len - t_len if first_query is None else first_query
    # -(w·log w).sum(-1) with two fp64 temporaries of the block, not five (the same operations, so the same bits)
    w = weights.to(torch.float64, copy=True).clamp_min_(0)
    ent = w.clamp_min(1e-30).log_().mul_(w).sum(-1).neg_()  # [B, H, T]
    del w
    visible = torch.arange(first, first + t_len, dtype=torch.float64) + 1  # keys each query sees
    keep = visible > 1
    norm = ent[..., keep] / torch.log(visible[keep])  # [B, H, T']
    return norm.sum(dim=(0, 2)), int(bsz * int(keep.sum()))


def select_heads(scores: torch.Tensor, rule: str, fraction: float) -> list[list[int]]:
    """scores [L, H] → selected head indices per layer (sorted)."""
    if rule not in HEAD_RULES:
        raise AttnkitError(f"unknown head-selection rule {rule!r}")
    layers, heads = scores.shape
    if rule == "all":
        return [list(range(heads)) for _ in range(layers)]
    k = max(1, math.ceil(fraction * heads - 1e-9))
    selected = []
    for row in scores:
        # stable sort: highest score first, ties by lower index
        order = sorted(range(heads), key=lambda h: (-float(row[h]), h))
        selected.append(sorted(order[:k]))
    return selected


def dex_config_fields(selected: list[list[int]], anneal_fraction: float, base_model_type: str, method: str = "dex") -> dict:
    """The `attnkit` block of a DEX model's config."""
    return {
        "method": method,
        "base_model_type": base_model_type,
        "selected_heads": [list(map(int, s)) for s in selected],
        "anneal_fraction": float(anneal_fraction),
        "lambda_init": [round(lambda_init_for_layer(i), 6) for i in range(len(selected))],
    }
