"""KV-cache budget arithmetic for MLA: candidate (kv_lora_rank, rope_dim) splits and per-layer ranks.

DeepSeek-V3 has one `kv_lora_rank` and one `qk_rope_head_dim` for all layers, so the native
choice under a budget is a uniform split; per-layer ranks (`allocate_ranks`) are only measured
(an engine would have to skip zero-padded latent channels to profit from them).
"""

from __future__ import annotations

import torch

from attnkit.converters.mla.layer import Shape

# Splits whose one-shot KL is within this fraction of the least are tied (`preferred`). On reference-mha at
# 30 % of the cache rope_dim 46 to 64 measure KL 0.1505-0.1509, within 0.3 %; on reference and reference-c the
# split after the least is 4 % and 16 % above it (docs/mla.md, `--choose-by heal`).
KL_TIE = 0.01


def max_rank(shape: Shape, rope_dim: int) -> int:
    """2 G d - d_r data channels (K-NoPE and V) + 1 channel for the latent norm (the transformers
    target's constant channel, the engine target's anchor channel)."""
    return 2 * shape.G * shape.d - rope_dim + 1


def budget_values(shape: Shape, fraction: float) -> int:
    """Cached values per token and layer allowed by `fraction` of the source's 2 G d."""
    return int(fraction * 2 * shape.G * shape.d + 1e-9)


def split_candidates(shape: Shape, total: int, rope_cap: int, points: int = 6,
                     norm_channel: bool = True) -> list[tuple[int, int]]:
    """(kv_lora_rank, rope_dim) pairs with rank + rope_dim <= total, rope_dim even and spread over
    [2, min(rope_cap, total - 2)], rank >= 2 and <= its maximum (a full latent caps the rank; without
    `norm_channel`, the attnkit format's latent, one less)."""
    hi = min(rope_cap, total - 2)
    if hi < 2:
        return []
    raw = torch.linspace(2, hi, points) if points > 1 else torch.tensor([float(hi)])
    rope_dims = sorted({max(2, min(hi - hi % 2, 2 * round(float(v) / 2))) for v in raw})
    return [(min(total - dr, max_rank(shape, dr) - (not norm_channel)), dr) for dr in rope_dims]


def refine_candidates(shape: Shape, total: int, tried: list[int], best: int, rope_cap: int,
                      norm_channel: bool = True) -> list[tuple[int, int]]:
    """Splits halfway between the best rope_dim and its tried neighbours (even, not yet tried)."""
    ordered = sorted(tried)
    i = ordered.index(best)
    out = []
    for j in (i - 1, i + 1):
        if 0 <= j < len(ordered):
            mid = (ordered[j] + best) // 4 * 2
            if mid not in tried and 2 <= mid <= min(rope_cap, total - 2) and mid not in [c[1] for c in out]:
                out.append((min(total - mid, max_rank(shape, mid) - (not norm_channel)), mid))
    return out


def preferred(rows: list[dict], tie: float = KL_TIE) -> list[dict]:
    """--kv-budget's table rows (`kl`, `rope_dim`), best first: the splits tied with the least KL (within `tie`
    of it, relative) widest RoPE key first, then the rest by KL. Why the width breaks a tie: healing can
    re-learn what a latent channel held but cannot give a NoPE component back its rotation, and at a tie the
    latent channels given up for rotated slots were worth nothing measurable. On reference-mha the two
    wider tied finalists, 64 and 58, heal to x1.068 / x1.067 of the source, the narrowest, 52, to x1.078
    (docs/finetune.md, "Which split heals best"); the other two models have no ties."""
    least = min(r["kl"] for r in rows)
    tied = lambda r: r["kl"] <= least * (1 + tie)  # noqa: E731
    return sorted(rows, key=lambda r: (0, -r["rope_dim"], r["kl"]) if tied(r) else (1, r["kl"], -r["rope_dim"]))


def allocate_ranks(spectra: list[torch.Tensor], total_rank: int, lo: int, hi: int, relative: bool = True) -> list[int]:
    """Per-layer kv_lora_rank (constant channel included) summing to `total_rank`, each in [lo, hi].

    spectra[l] are layer l's descending latent PCA eigenvalues: data channel k (rank k + 1) removes
    spectra[l][k - 1] from that layer's objective. Greedy = optimal here (gains decrease within a
    layer). relative: each layer's gains as a fraction of its total (layers' metric units differ).
    """
    n_layers = len(spectra)
    if not lo * n_layers <= total_rank <= hi * n_layers:
        raise ValueError(f"total rank {total_rank} outside {lo * n_layers}..{hi * n_layers}")
    gains = []
    for layer, s in enumerate(spectra):
        s = s.double() / (s.sum().clamp_min(1e-300) if relative else 1.0)
        for k in range(lo, hi):  # going from rank k to k + 1 adds data channel k
            gains.append((float(s[k - 1]) if k - 1 < s.numel() else 0.0, layer))
    gains.sort(key=lambda g: -g[0])
    ranks = [lo] * n_layers
    for _, layer in gains[: total_rank - lo * n_layers]:
        ranks[layer] += 1
    return ranks
