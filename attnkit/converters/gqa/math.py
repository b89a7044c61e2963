"""GQA / MHA -> GQA with fewer KV heads, the math (pure functions over one layer's tensors).

Notation: hidden D, query heads H, source KV heads G, target KV heads N, group size m = G / N,
head dim d. Every statistic comes from the second moment Mom = E[x~ x~^T] of the attention input
x~ = [x; 1] (`mla.source.Moment`): keys, values and queries are affine in x, so their (cross-)
covariances are W~_a Mom W~_b^T with W~ = [W | b].

Alignment (exact, folded into the other side of each product):
- keys: rotate-half RoPE pairs dims (i, i + d/2) of a head and rotates each pair by a position angle.
  A per-pair T_i = s_i R_i (R_i in SO(2), s_i > 0) commutes with that rotation, so k' = T k per pair
  and q' = T^{-T} q = R q / s per pair (every query head of the KV head's group) leave every score
  q . k unchanged at every position. R_i (and s_i) is fitted by 2-D Procrustes on calibration keys.
- values: any orthogonal M per KV head: v' = M v and the o_proj columns of its query heads O_h M^T.
Merge: the m aligned heads of a group become one:
- keys, per pair: the mean weighted by the pair's query energy w_{g,i} = sum_{h in g} E|q'_{h,i}|^2.
  With RoPE the relative angle between a query and a key varies with distance; averaged over it, the
  score error of query head h is E|q'_{h,i}|^2 E|k'_{g,i} - k_i|^2 / 2 per pair (query and key come
  from different tokens), so this weighted mean is the least-squares merged key of the group.
- values: the o_proj-weighted least squares sum_g A_g (v'_g - v), A_g = sum_{h in g} O'_h^T O'_h:
  v = (sum_g A_g)^{-1} sum_g A_g v'_g, which is what the output projection sees of the value error.
- queries, per head and pair: the complex factor (a scaled rotation, exact under RoPE) that best keeps
  the head's scores against its own source key when it now meets the merged key (`refit_queries`).
`mean` is the classic uptraining initialisation (Ainslie et al. 2023): contiguous groups, plain mean
of the K and V projections, queries and o_proj untouched.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from attnkit.converters.mla.layer import AttnWeights, Shape

GPA_ITERATIONS = 4  # generalised Procrustes: align to the group's (weighted) mean, recompute, repeat
MAX_PARTITIONS = 20000
QUERY_REFIT = True  # measured on the reference at N = 1: one-shot ppl 39.92 -> 39.48 (docs/gqa-vs-mla.md)  # equal-size groupings enumerated exhaustively below this count, else greedy + swaps


@dataclass
class Heads:
    """One layer's attention per head, augmented with its bias column (fp64).

    q: [H, d, D+1], k/v: [G, d, D+1], o: [H, D, d], bo: [D] or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    bo: torch.Tensor | None
    has_bias: bool  # q/k/v biases present (written back as biases)

    @property
    def group_size(self) -> int:
        return self.q.shape[0] // self.k.shape[0]


def _aug(w: torch.Tensor, b: torch.Tensor | None, heads: int, d: int) -> torch.Tensor:
    w = w.double().reshape(heads, d, -1)
    b = torch.zeros(heads, d, 1, dtype=torch.float64) if b is None else b.double().reshape(heads, d, 1)
    return torch.cat([w, b], dim=-1)


def split_heads(aw: AttnWeights, shape: Shape) -> Heads:
    H, G, d = shape.H, shape.G, shape.d
    o = aw.wo.double().reshape(aw.wo.shape[0], H, d).permute(1, 0, 2).contiguous()
    return Heads(_aug(aw.wq, aw.bq, H, d), _aug(aw.wk, aw.bk, G, d), _aug(aw.wv, aw.bv, G, d), o,
                 None if aw.bo is None else aw.bo.double(), aw.bk is not None or aw.bq is not None or aw.bv is not None)


def join_heads(h: Heads, dtype: torch.dtype = torch.float32) -> AttnWeights:
    """Back to row-major projections; biases only when the source had them."""
    def w(x):
        return x[..., :-1].reshape(-1, x.shape[-1] - 1).to(dtype)

    def b(x):
        return x[..., -1].reshape(-1).to(dtype) if h.has_bias else None

    wo = h.o.permute(1, 0, 2).reshape(h.o.shape[1], -1).to(dtype)
    return AttnWeights(w(h.q), w(h.k), w(h.v), wo, b(h.q), b(h.k), b(h.v), None if h.bo is None else h.bo.to(dtype))


# ---------------------------------------------------------------- RoPE pairs


def pairs(x: torch.Tensor) -> torch.Tensor:
    """[..., d, C] -> [..., d/2, 2, C]: pair i is rows (i, i + d/2) (rotate-half RoPE)."""
    half = x.shape[-2] // 2
    return torch.stack([x[..., :half, :], x[..., half:, :]], dim=-2)


def unpairs(p: torch.Tensor) -> torch.Tensor:
    return torch.cat([p[..., 0, :], p[..., 1, :]], dim=-2)


def pair_cross(a: torch.Tensor, b: torch.Tensor, mom: torch.Tensor) -> torch.Tensor:
    """E[b_i a_i^T] per pair for key heads a, b [d, D+1]: [d/2, 2, 2]."""
    return torch.einsum("ipc,cs,iqs->ipq", pairs(b), mom, pairs(a))


def pair_energy(x: torch.Tensor, mom: torch.Tensor) -> torch.Tensor:
    """E|x_i|^2 per pair for heads [..., d, D+1]: [..., d/2]."""
    p = pairs(x)
    return torch.einsum("...ipc,cs,...ips->...i", p, mom, p)


def rotation(theta: torch.Tensor) -> torch.Tensor:
    """[n] angles -> [n, 2, 2] rotations acting on (x_i, x_{i+d/2}) column vectors."""
    c, s = torch.cos(theta), torch.sin(theta)
    return torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)


def fit_pair_maps(target: torch.Tensor, head: torch.Tensor, mom: torch.Tensor, scale: bool) -> torch.Tensor:
    """Per pair T_i = s_i R_i (R_i in SO(2)) minimising E|T_i k_i - t_i|^2: [d/2, 2, 2].

    tr(R P) with P = E[k t^T] is c (P11 + P22) + s (P12 - P21), so the angle is atan2 of the two."""
    p = pair_cross(target, head, mom)
    alpha, beta = p[:, 0, 0] + p[:, 1, 1], p[:, 0, 1] - p[:, 1, 0]
    r = rotation(torch.atan2(beta, alpha))
    if not scale:
        return r
    s = torch.sqrt(alpha**2 + beta**2) / pair_energy(head, mom).clamp_min(1e-30)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return r * s[:, None, None]


def apply_key_maps(h: Heads, maps: torch.Tensor) -> Heads:
    """maps [G, d/2, 2, 2]: k' = T k per pair; every query head of KV head g: q' = T^{-T} q (exact)."""
    k = unpairs(torch.einsum("gipq,giqc->gipc", maps, pairs(h.k)))
    inv_t = torch.linalg.inv(maps).transpose(-1, -2)  # [G, d/2, 2, 2]
    per_q = inv_t.repeat_interleave(h.group_size, dim=0)
    q = unpairs(torch.einsum("hipq,hiqc->hipc", per_q, pairs(h.q)))
    return Heads(q, k, h.v, h.o, h.bo, h.has_bias)


def fit_value_map(target: torch.Tensor, head: torch.Tensor, mom: torch.Tensor) -> torch.Tensor:
    """Orthogonal M [d, d] maximising E[t^T M v] (Procrustes): C = E[v t^T] = U S V^T, M = V U^T."""
    c = head @ mom @ target.T
    u, _, vt = torch.linalg.svd(c)
    return vt.T @ u.T


def apply_value_maps(h: Heads, maps: torch.Tensor) -> Heads:
    """maps [G, d, d] orthogonal: v' = M v, o_proj columns of each query head O_h M^T (exact)."""
    v = maps @ h.v
    o = h.o @ maps.transpose(-1, -2).repeat_interleave(h.group_size, dim=0)
    return Heads(h.q, h.k, v, o, h.bo, h.has_bias)


# ---------------------------------------------------------------- weights of the merge


def key_weights(h: Heads, mom: torch.Tensor) -> torch.Tensor:
    """w[g, i] = sum over query heads of KV head g of E|q_{h,i}|^2: [G, d/2]."""
    e = pair_energy(h.q, mom)  # [H, d/2]
    return e.reshape(h.k.shape[0], h.group_size, -1).sum(1)


def value_metrics(h: Heads) -> torch.Tensor:
    """A_g = sum over query heads of KV head g of O_h^T O_h: [G, d, d]."""
    a = h.o.transpose(-1, -2) @ h.o  # [H, d, d]
    return a.reshape(h.k.shape[0], h.group_size, *a.shape[1:]).sum(1)


def merge_keys(k: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """k [m, d, C] -> [d, C]: per pair the w-weighted mean (plain mean without w)."""
    if w is None:
        return k.mean(0)
    w = w / w.sum(0, keepdim=True).clamp_min(1e-300)
    return unpairs((pairs(k) * w[:, :, None, None]).sum(0))


def merge_values(v: torch.Tensor, a: torch.Tensor | None) -> torch.Tensor:
    """v [m, d, C] -> [d, C]: (sum A_g)^{-1} sum A_g v_g (plain mean without A)."""
    if a is None:
        return v.mean(0)
    total = a.sum(0)
    ridge = 1e-9 * total.diagonal().mean().clamp_min(1e-300) * torch.eye(total.shape[0], dtype=total.dtype)
    return torch.linalg.solve(total + ridge, (a @ v).sum(0))


# ---------------------------------------------------------------- alignment within a group


def align_group(h: Heads, members: list[int], mom: torch.Tensor, scale: bool,
                iterations: int = GPA_ITERATIONS) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Procrustes over one group: each head's key maps [m, d/2, 2, 2] and value maps
    [m, d, d] onto the group's merge target (its weighted mean), re-fitted `iterations` times."""
    d = h.k.shape[1]
    kw, va = key_weights(h, mom), value_metrics(h)
    energy = kw.sum(1)[members]
    first = members[int(energy.argmax())]  # the start target: the head the queries weigh most
    t_k, t_v = h.k[first], h.v[first]
    k_maps = torch.eye(2, dtype=torch.float64).expand(len(members), d // 2, 2, 2).clone()
    v_maps = torch.eye(d, dtype=torch.float64).expand(len(members), d, d).clone()
    for _ in range(iterations):
        k_maps = torch.stack([fit_pair_maps(t_k, h.k[g], mom, scale) for g in members])
        v_maps = torch.stack([fit_value_map(t_v, h.v[g], mom) for g in members])
        k_al = unpairs(torch.einsum("gipq,giqc->gipc", k_maps, pairs(h.k[members])))
        # query energy seen through T^{-T}: E|q'_i|^2 = E|q_i|^2 / s_i^2 (R is orthogonal)
        s2 = (k_maps[:, :, 0, 0] ** 2 + k_maps[:, :, 1, 0] ** 2)
        t_k = merge_keys(k_al, kw[members] / s2)
        t_v = merge_values(v_maps @ h.v[members], va[members])
    return k_maps, v_maps


def align_all(h: Heads, groups: list[list[int]], mom: torch.Tensor, scale: bool) -> Heads:
    """Every KV head aligned within its group (exact: the layer computes the same function)."""
    G, d = h.k.shape[0], h.k.shape[1]
    k_maps = torch.empty(G, d // 2, 2, 2, dtype=torch.float64)
    v_maps = torch.empty(G, d, d, dtype=torch.float64)
    for members in groups:
        km, vm = align_group(h, members, mom, scale)
        k_maps[members], v_maps[members] = km, vm
    return apply_value_maps(apply_key_maps(h, k_maps), v_maps)


# ---------------------------------------------------------------- grouping


def pair_costs(h: Heads, mom: torch.Tensor) -> torch.Tensor:
    """[G, G] dissimilarity after alignment: relative residual of the best RoPE-pair rotation of the
    keys (pairs weighted by both heads' query energy) plus that of the best orthogonal map of the values."""
    G = h.k.shape[0]
    kw, ek, ev = key_weights(h, mom), pair_energy(h.k, mom), torch.einsum("gdc,cs,gds->g", h.v, mom, h.v)
    cost = torch.zeros(G, G, dtype=torch.float64)
    for a, b in itertools.combinations(range(G), 2):
        p = pair_cross(h.k[a], h.k[b], mom)
        fit = torch.sqrt((p[:, 0, 0] + p[:, 1, 1]) ** 2 + (p[:, 0, 1] - p[:, 1, 0]) ** 2)
        w = kw[a] + kw[b]
        tot = ek[a] + ek[b]
        key = float((w * (tot - 2 * fit)).sum() / (w * tot).sum().clamp_min(1e-300))
        sv = torch.linalg.svdvals(h.v[b] @ mom @ h.v[a].T).sum()
        val = float((ev[a] + ev[b] - 2 * sv) / (ev[a] + ev[b]).clamp_min(1e-300))
        cost[a, b] = cost[b, a] = key + val
    return cost


def _partitions(items: list[int], size: int):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        left = [x for x in rest if x not in others]
        for tail in _partitions(left, size):
            yield [[first, *others], *tail]


def partition_count(n_items: int, n_groups: int) -> int:
    size = n_items // n_groups
    return math.factorial(n_items) // (math.factorial(size) ** n_groups * math.factorial(n_groups))


def _within(cost: torch.Tensor, groups: list[list[int]]) -> float:
    return float(sum(cost[a, b] for g in groups for a, b in itertools.combinations(g, 2)))


def choose_groups(cost: torch.Tensor, n_groups: int) -> list[list[int]]:
    """Equal-size groups of KV heads minimising the summed within-group cost: exhaustive when the
    partitions are few, else greedy seeds grown by least cost and improved by pairwise swaps."""
    G = cost.shape[0]
    size = G // n_groups
    if size == 1:
        return [[g] for g in range(G)]
    if partition_count(G, n_groups) <= MAX_PARTITIONS:
        best = min(_partitions(list(range(G)), size), key=lambda p: _within(cost, p))
    else:
        left, best = set(range(G)), []
        while left:
            seed = min(left)
            group = [seed]
            while len(group) < size:
                nxt = min(sorted(left - set(group)), key=lambda x: float(cost[x, group].sum()))
                group.append(nxt)
            best.append(group)
            left -= set(group)
        improved = True
        while improved:
            improved = False
            for gi, gj in itertools.combinations(range(len(best)), 2):
                for a, b in itertools.product(range(size), range(size)):
                    trial = [list(g) for g in best]
                    trial[gi][a], trial[gj][b] = best[gj][b], best[gi][a]
                    if _within(cost, trial) < _within(cost, best) - 1e-12:
                        best, improved = trial, True
    return sorted(sorted(g) for g in best)


def contiguous_groups(G: int, n_groups: int) -> list[list[int]]:
    size = G // n_groups
    return [list(range(i * size, (i + 1) * size)) for i in range(n_groups)]


# ---------------------------------------------------------------- the merge


def merge(h: Heads, groups: list[list[int]], mom: torch.Tensor | None, weighted: bool) -> Heads:
    """One KV head per group; query heads (and o_proj columns) reordered so that group j's query
    heads are contiguous (query head h of the output attends to KV head h // (H / N))."""
    m_q = h.group_size
    kw = key_weights(h, mom) if weighted else None
    va = value_metrics(h) if weighted else None
    ks, vs, q_order = [], [], []
    for members in groups:
        ks.append(merge_keys(h.k[members], None if kw is None else kw[members]))
        vs.append(merge_values(h.v[members], None if va is None else va[members]))
        q_order += [g * m_q + j for g in members for j in range(m_q)]
    return Heads(h.q[q_order], torch.stack(ks), torch.stack(vs), h.o[q_order], h.bo, h.has_bias)


def refit_queries(aligned: Heads, merged: Heads, groups: list[list[int]], mom: torch.Tensor) -> Heads:
    """Per query head and RoPE pair, the complex factor (a scaled rotation, so it commutes with RoPE)
    that best reproduces the head's source scores with the merged key, averaged over the relative
    angle: with pairs as complex numbers, q'_i = q_i E[k_m conj(k_g)] / E|k_m|^2 minimises
    E|conj(q') k_m - conj(q) k_g|^2 (query and key from different tokens)."""
    m_q = aligned.group_size
    q = merged.q.clone()
    row = 0
    for j, members in enumerate(groups):
        e_m = pair_energy(merged.k[j], mom).clamp_min(1e-300)  # [d/2]
        for g in members:
            p = pair_cross(aligned.k[g], merged.k[j], mom)  # E[k_m k_g^T] per pair
            cr, ci = (p[:, 0, 0] + p[:, 1, 1]) / e_m, (p[:, 1, 0] - p[:, 0, 1]) / e_m
            f = torch.stack([torch.stack([cr, -ci], -1), torch.stack([ci, cr], -1)], -2)  # [d/2, 2, 2]
            for _ in range(m_q):
                q[row] = unpairs(torch.einsum("ipq,iqc->ipc", f, pairs(q[row])))
                row += 1
    return Heads(q, merged.k, merged.v, merged.o, merged.bo, merged.has_bias)


def convert_layer(aw: AttnWeights, shape: Shape, n_kv: int, method: str, mom: torch.Tensor,
                  scale: bool = True) -> tuple[dict[str, AttnWeights], dict]:
    """The stages of one layer ({"align": ..., "merge": ...} for `aligned`, {"merge": ...} for
    `mean`), fp32, and what the report says of the layer (groups, their costs)."""
    h = split_heads(aw, shape)
    if method == "mean":
        groups = contiguous_groups(shape.G, n_kv)
        return {"merge": join_heads(merge(h, groups, None, weighted=False))}, {"groups": groups}
    cost = pair_costs(h, mom)
    by_index = contiguous_groups(shape.G, n_kv)
    groups = choose_groups(cost, n_kv)
    aligned = align_all(h, groups, mom, scale)
    del h  # the source's fp64 heads (84 MB at a 1B width) are not read again
    info = {"groups": groups, "within_group_cost": _within(cost, groups), "within_group_cost_by_index": _within(cost, by_index)}
    merged = merge(aligned, groups, mom, weighted=True)
    if QUERY_REFIT:
        merged = refit_queries(aligned, merged, groups, mom)
    return {"align": join_heads(aligned), "merge": join_heads(merged)}, info
