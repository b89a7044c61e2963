"""GQA / MHA / MQA -> MLA, the math (pure functions over one layer's tensors; docs/mla.md, "What the
converter does").

Notation: hidden D, query heads H, KV heads G, head dim d, RoPE dim d_r, latent rank m.
A key head's dims pair up for rotate-half RoPE: pair i in [0, d/2) is dims (i, i + d/2) at
frequency w_i. Per pair i an orthogonal G x G rotation U_i across KV heads (rows = virtual
heads j) commutes with RoPE, so keys k'_{j,i} = sum_g U_i[j,g] k_{g,i} and queries
U_i[j,g(h)] q_{h,i} give the same scores. Kept (j, i) components go to the shared RoPE key
k_pe; the others are NoPE and, with V, form the latent (optionally low-rank).

Every stage is returned as `MLAParams` (DeepSeek layout before the latent RMSNorm) and run by
`mla_attention`, so each step's error is measured on the same code path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from attnkit.sdpa import sdpa
from attnkit.converters.mla.rope import apply_rope, cos_sin, geometric_slot_of


@dataclass(frozen=True)
class Shape:
    D: int
    H: int
    G: int
    d: int

    @property
    def group(self) -> torch.Tensor:  # g(h) for every query head
        return torch.arange(self.H) // (self.H // self.G)


@dataclass
class AttnWeights:
    """One source layer's attention (rows are output features, any float dtype)."""

    wq: torch.Tensor  # [H*d, D]
    wk: torch.Tensor  # [G*d, D]
    wv: torch.Tensor  # [G*d, D]
    wo: torch.Tensor  # [D, H*d]
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    bo: torch.Tensor | None = None


@dataclass
class RopePlan:
    rot: torch.Tensor  # [d/2, G, G]: U_i, rows = virtual heads
    kept_j: torch.Tensor  # [d_r/2] virtual head of each RoPE slot
    kept_i: torch.Tensor  # [d_r/2] source frequency pair of each slot
    inv_freq: torch.Tensor  # [d_r/2] frequency each slot is rotated at in the output

    @property
    def d_r(self) -> int:
        return 2 * self.kept_i.numel()


@dataclass
class MLAParams:
    """A layer in DeepSeek-V3 layout without the latent norm; biases may be None."""

    q_w: torch.Tensor  # [H, d + d_r, D]  (softmax-scale change folded in)
    q_b: torch.Tensor | None  # [H, d + d_r]
    lat_w: torch.Tensor  # [m, D]
    lat_b: torch.Tensor | None  # [m]
    pe_w: torch.Tensor  # [d_r, D]
    pe_b: torch.Tensor | None  # [d_r]
    kvb_w: torch.Tensor  # [H, 2d, m]  per head [k_nope d | v d]
    kvb_b: torch.Tensor | None  # [H, 2d]
    o_w: torch.Tensor  # [D, H*d]
    o_b: torch.Tensor | None
    inv_freq: torch.Tensor  # [d_r/2]
    scale: float  # softmax scale used by the target
    rope_scaling: float = 1.0  # attention_scaling the target applies to cos/sin


def augmented(w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """[W | b] (fp64 by default) so that W x + b = [W | b] [x; 1]."""
    bias = torch.zeros(w.shape[0], 1, dtype=dtype) if b is None else b.to(dtype)[:, None]
    return torch.cat([w.to(dtype), bias], dim=1)


def _heads(w_aug: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    return w_aug.view(heads, d, -1)  # [heads*d, D+1] -> [heads, d, D+1]


def _pair_energy(rows: torch.Tensor, moment: torch.Tensor) -> torch.Tensor:
    """E[(r.x~)^2] for rows [..., D+1] under the second moment E[x~ x~^T]."""
    return torch.einsum("...a,ab,...b->...", rows, moment, rows)


def rope_scores(aw: AttnWeights, moment: torch.Tensor, shape: Shape, method: str,
                damping: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotations U [d/2, G, G], score [d/2, G] of each (frequency, virtual head) component).

    rorope: U_i = eigenvectors of the G x G key covariance at frequency i; score = key energy.
    partial: U_i = I; score = sum over the group's query heads of sqrt(E|q_hi|^2) sqrt(E|k_gi|^2).

    damping [H, d/2] (rorope only): 1 - |E_w R(-Delta w_i)|^2 per query head and frequency, the part of
    a rotation the query refit cannot replace by its mean (`refit.rope_damping`). The score is then
    what NoPE'ing the component leaves of the score error after the refit, for independent q and k:
    lambda_ij * sum_h U_i[j, g(h)]^2 E|q_hi|^2 damping_hi (see `loss_scores`).
    """
    G, d, half = shape.G, shape.d, shape.d // 2
    k = _heads(augmented(aw.wk, aw.bk), G, d)  # [G, d, D+1]
    k_pairs = torch.stack([k[:, :half], k[:, half:]], dim=0)  # [2, G, d/2, D+1]
    # cov[i, g, g'] = sum_c E[k_{g,i,c} k_{g',i,c}]
    cov = torch.einsum("cgia,ab,chib->igh", k_pairs, moment, k_pairs)
    if method == "rorope":
        evals, evecs = torch.linalg.eigh(cov)  # ascending
        rot = evecs.flip(-1).transpose(1, 2).contiguous()  # rows = eigvecs, strongest first
        energy = evals.flip(-1).clamp_min(0)
        if damping is None:
            return rot, energy
        return rot, loss_scores(aw, moment, shape, rot, energy, damping)
    if method == "partial":
        rot = torch.eye(G, dtype=torch.float64).expand(half, G, G).contiguous()
        q = _heads(augmented(aw.wq, aw.bq), shape.H, d)
        q_e = _pair_energy(q[:, :half], moment) + _pair_energy(q[:, half:], moment)  # [H, d/2]
        k_e = torch.diagonal(cov, dim1=1, dim2=2)  # [d/2, G]
        q_group = torch.zeros(G, half, dtype=torch.float64).index_add_(0, shape.group, q_e.clamp_min(0).sqrt())
        return rot, q_group.T * k_e.clamp_min(0).sqrt()
    raise ValueError(f"unknown rope method {method!r}")


def loss_scores(aw: AttnWeights, moment: torch.Tensor, shape: Shape, rot: torch.Tensor, energy: torch.Tensor,
                damping: torch.Tensor) -> torch.Tensor:
    """[d/2, G] expected squared score error of NoPE'ing each rorope component after the query refit.

    Head h scores virtual key head j at pair i with U_i[j, g(h)] q_hi; the refit replaces the
    rotation R(-Delta w_i) by its mean, leaving E|R - Rbar|^2 = 2 (1 - |Rbar|^2) = 2 damping_hi."""
    H, d, half = shape.H, shape.d, shape.d // 2
    q = _heads(augmented(aw.wq, aw.bq), H, d)  # [H, d, D+1]
    q_e = (_pair_energy(q[:, :half], moment) + _pair_energy(q[:, half:], moment)).clamp_min(0)  # [H, d/2]
    u2 = rot[:, :, shape.group] ** 2  # [d/2, G(j), H]
    return energy * torch.einsum("ijh,hi->ij", u2, q_e * damping.double())


def slot_counts(scores: list[torch.Tensor], d_r: int) -> torch.Tensor:
    """How many RoPE slots each frequency gets, shared by all layers (one config serves them all).

    The k-th slot at frequency i is worth the sum over layers of each layer's k-th best component
    there; the d_r/2 most valuable (frequency, k) pairs win. Returns counts [d/2] (each <= G).
    """
    stacked = torch.stack([s / s.sum().clamp_min(1e-30) for s in scores])  # [L, d/2, G], layers weigh equally
    gain = stacked.sort(dim=-1, descending=True).values.sum(0)  # [d/2, G]
    top = torch.argsort(gain.reshape(-1), descending=True, stable=True)[: d_r // 2]
    return torch.bincount(top // gain.shape[1], minlength=gain.shape[0])


def plan_rope(aw: AttnWeights, moment: torch.Tensor, shape: Shape, d_r: int, method: str,
              src_inv_freq: torch.Tensor, frequencies: str = "exact",
              target_inv_freq: torch.Tensor | None = None, counts: torch.Tensor | None = None,
              stride: int = 1, damping: torch.Tensor | None = None) -> RopePlan:
    """Choose the rotation per frequency and the d_r/2 (virtual head, frequency) components kept.

    exact frequencies: `counts[i]` strongest components at frequency i (default: this layer's own
    global top d_r/2); ladder: slot s keeps source pair `stride * s` (its strongest virtual head),
    at the exported ladder's frequency (exact for a default-RoPE source); geometric: the best
    component per slot of the plain d_r ladder (the slot's frequency replaces the component's:
    folding, lossy).
    """
    G, d, half = shape.G, shape.d, shape.d // 2
    rot, score = rope_scores(aw, moment, shape, method, damping)
    if frequencies == "ladder":
        kept_i = torch.arange(d_r // 2) * stride
        kept_j = score[kept_i].argmax(dim=1)
        inv_freq = target_inv_freq.double()
    elif frequencies == "exact":
        if counts is None:
            counts = slot_counts([score], d_r)
        order = torch.argsort(score, dim=1, descending=True, stable=True)  # [d/2, G]
        kept_i = torch.arange(half).repeat_interleave(counts)
        kept_j = torch.cat([order[i, : int(c)] for i, c in enumerate(counts)]) if kept_i.numel() else kept_i
        inv_freq = src_inv_freq[kept_i].double()
    else:
        slots = torch.tensor([geometric_slot_of(i, d, d_r) for i in range(half)])
        kept_i, kept_j = [], []
        for s in range(d_r // 2):
            cand = torch.nonzero(slots == s).flatten()
            best = int(torch.argmax(score[cand].reshape(-1)))
            kept_i.append(int(cand[best // G]))
            kept_j.append(best % G)
        kept_i, kept_j = torch.tensor(kept_i), torch.tensor(kept_j)
        inv_freq = target_inv_freq.double()
    return RopePlan(rot=rot, kept_j=kept_j, kept_i=kept_i, inv_freq=inv_freq)


def identity_plan(shape: Shape, src_inv_freq: torch.Tensor) -> RopePlan:
    """Every component of every KV head kept at its own frequency: the exact rewrite (d_r = G d)."""
    G, half = shape.G, shape.d // 2
    i = torch.arange(half).repeat_interleave(G)
    j = torch.arange(G).repeat(half)
    rot = torch.eye(G, dtype=torch.float64).expand(half, G, G).contiguous()
    return RopePlan(rot=rot, kept_j=j, kept_i=i, inv_freq=src_inv_freq[i].double())


@dataclass
class RopeSplit:
    pe: torch.Tensor  # [d_r, D+1] rows of k_pe (first half c=0, second half c=1)
    nope: torch.Tensor  # [n, D+1] NoPE key rows, n = G d - d_r
    back: torch.Tensor  # [G, d, n]: k_nope of a head in group g = back[g] @ nope
    q_pe: torch.Tensor  # [G, d_r, d]: q_pe of a head in group g = q_pe[g] @ q_h


def split_keys(aw: AttnWeights, plan: RopePlan, shape: Shape, dtype: torch.dtype = torch.float64) -> RopeSplit:
    G, d, half = shape.G, shape.d, shape.d // 2
    k = _heads(augmented(aw.wk, aw.bk, dtype), G, d)
    rotated = torch.einsum("ijg,gcia->jica", plan.rot.to(dtype), k.view(G, 2, half, -1))  # [G(j), d/2, 2, D+1]
    kept = torch.zeros(G, half, dtype=torch.bool)
    kept[plan.kept_j, plan.kept_i] = True
    pe = torch.cat([rotated[plan.kept_j, plan.kept_i, c] for c in (0, 1)])  # [d_r, D+1]
    nope_idx = torch.nonzero(~kept)  # (j, i) pairs, each gives two rows (c = 0, 1)
    nope = torch.cat([rotated[nope_idx[:, 0], nope_idx[:, 1], c] for c in (0, 1)])  # [n, D+1]
    n_pairs = nope_idx.shape[0]
    back = torch.zeros(G, d, 2 * n_pairs, dtype=dtype)
    q_pe = torch.zeros(G, plan.d_r, d, dtype=dtype)
    s_half = plan.d_r // 2
    for c in (0, 1):
        for row, (j, i) in enumerate(nope_idx.tolist()):
            back[:, i + c * half, row + c * n_pairs] = plan.rot[i, j, :].to(dtype)
        for s, (j, i) in enumerate(zip(plan.kept_j.tolist(), plan.kept_i.tolist())):
            q_pe[:, s + c * s_half, i + c * half] = plan.rot[i, j, :].to(dtype)
    return RopeSplit(pe=pe, nope=nope, back=back, q_pe=q_pe)


def balance_factor(split: RopeSplit, aw: AttnWeights, moment: torch.Tensor, metrics=None) -> float:  # fp64
    """beta with E|beta K_nope|^2 = E|V|^2 (in metric units if given), so neither dominates the PCA."""
    if split.nope.shape[0] == 0:
        return 1.0
    k_rows, v_rows = split.nope, augmented(aw.wv, aw.bv)
    if metrics is not None:
        k_rows, v_rows = metrics[0] @ k_rows, metrics[2] @ v_rows
    k_e = _pair_energy(k_rows, moment).sum()
    v_e = _pair_energy(v_rows, moment).sum()
    return float((v_e / k_e.clamp_min(1e-30)).sqrt()) if k_e > 0 else 1.0


def _sqrt_pair(m: torch.Tensor, floor: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(M^1/2, M^-1/2) of a symmetric PSD matrix, eigenvalues floored at floor * max."""
    evals, evecs = torch.linalg.eigh(m.double())
    evals = evals.clamp_min(floor * float(evals.max().clamp_min(1e-300)))
    return (evecs * evals.sqrt()) @ evecs.T, (evecs * evals.rsqrt()) @ evecs.T


def attention_metrics(aw: AttnWeights, split: RopeSplit, shape: Shape, moment: torch.Tensor):
    """(A_k, A_k^-1, A_v, A_v^-1): square roots of the metrics under which latent errors matter.

    K-NoPE: a key error dk changes head h's score by q_h . back[g] dk, so its metric is
    sum_h back_g^T E[q_h q_h^T] back_g. V: a value error dv changes the output by Wo_h dv, metric
    sum_h Wo_h^T Wo_h per group (cross-head terms ignored). Exact transforms: no error by themselves.
    """
    H, G, d = shape.H, shape.G, shape.d
    q = _heads(augmented(aw.wq, aw.bq), H, d)
    qq = torch.einsum("hda,ab,heb->hde", q, moment, q)  # [H, d, d]
    back = split.back[shape.group]  # [H, d, n]
    m_k = torch.einsum("hdn,hde,hem->nm", back, qq, back)
    wo = aw.wo.double().view(-1, H, d)  # [D, H, d]
    oo = torch.einsum("xhd,xhe->hde", wo, wo)  # [H, d, d]
    m_v = torch.zeros(G * d, G * d, dtype=torch.float64)
    for h, g in enumerate(shape.group.tolist()):
        m_v[g * d:(g + 1) * d, g * d:(g + 1) * d] += oo[h]
    return (*_sqrt_pair(m_k), *_sqrt_pair(m_v)) if m_k.numel() else (m_k, m_k, *_sqrt_pair(m_v))


def build_stage(aw: AttnWeights, plan: RopePlan, shape: Shape, moment: torch.Tensor, *, scale_src: float,
                scale_tgt: float, rope_src: float = 1.0, rope_tgt: float = 1.0, beta: float = 1.0,
                rank: int | None = None, dtype: torch.dtype = torch.float64, metrics=None,
                map_dtype: torch.dtype | None = None, centred: bool = True) -> MLAParams:
    """MLA parameters for one layer: rope plan applied, K-NoPE scaled by beta, latent of `rank`
    (None = full, no factorisation) chosen by activation-aware PCA under `moment`: centred (the
    mean goes through a kv_b bias, carried by a constant channel) or not (no bias anywhere: the
    latent is a plain projection of the layer's [K-NoPE; V], what the engine export needs). `dtype` is the
    working precision (fp32 suffices for the exact rewrite, whose maps are 0/1); `map_dtype` (default
    `dtype`) that of the query and output maps, which are only rescaled and rotated."""
    H, G, d, D = shape.H, shape.G, shape.d, shape.D
    split = split_keys(aw, plan, shape, dtype)
    n, d_r = split.nope.shape[0], plan.d_r
    g_of = shape.group
    # Source scores carry rope_src^2 on every dim; the target's RoPE part carries rope_tgt^2.
    c_nope = (scale_src / scale_tgt) * rope_src**2
    c_pe = (scale_src / scale_tgt) * (rope_src / rope_tgt) ** 2
    # built head by head: no [H, d, D+1] fp64 copy of the source query (a 1B model's is 34 MB)
    w_dtype = map_dtype or dtype
    q_w = torch.empty(H, d + d_r, D, dtype=w_dtype)
    q_b = torch.empty(H, d + d_r, dtype=w_dtype)
    for h, g in enumerate(g_of.tolist()):
        rows = slice(h * d, (h + 1) * d)
        q_h = augmented(aw.wq[rows], None if aw.bq is None else aw.bq[rows], dtype)  # [d, D+1]
        pe = split.q_pe[g] @ q_h  # [d_r, D+1]
        q_w[h, :d], q_b[h, :d] = q_h[:, :D] * c_nope, q_h[:, D] * c_nope
        q_w[h, d:], q_b[h, d:] = pe[:, :D] * c_pe, pe[:, D] * c_pe
    latent = latent_rows(split, aw, beta, metrics, dtype)  # [n + G d, D+1]
    k_inv = v_inv = None
    if metrics is not None:
        k_inv, v_inv = metrics[1].to(dtype), metrics[3].to(dtype)
    # per head map latent -> [k_nope d | v d]
    up = torch.zeros(H, 2 * d, n + G * d, dtype=dtype)
    up[:, :d, :n] = (split.back[g_of] if k_inv is None else split.back[g_of] @ k_inv) / beta
    for h, g in enumerate(g_of.tolist()):
        if v_inv is None:
            up[h, d:, n + g * d: n + (g + 1) * d] = torch.eye(d, dtype=dtype)
        else:
            up[h, d:, n:] = v_inv[g * d:(g + 1) * d]
    lat_w, lat_b = latent[:, :D], latent[:, D]
    kvb_w, kvb_b = up, None
    if rank is not None and not centred:
        basis = top_eigvecs(latent @ moment.to(dtype) @ latent.T, rank)  # [n + G d, rank], second moment
        lat_w, lat_b = basis.T @ lat_w, basis.T @ lat_b
        kvb_w = up @ basis
    elif rank is not None:
        moment = moment.to(dtype)
        mean = moment[:D, D] / moment[D, D]
        cov = moment[:D, :D] / moment[D, D] - torch.outer(mean, mean)
        basis = top_eigvecs(lat_w @ cov @ lat_w.T, rank)  # [n + G d, rank]
        kvb_b = up @ (lat_w @ mean + lat_b)  # [H, 2d]
        lat_w, lat_b = basis.T @ lat_w, -(basis.T @ lat_w @ mean)
        kvb_w = up @ basis
    return MLAParams(
        q_w=q_w, q_b=None if aw.bq is None else q_b,
        lat_w=lat_w, lat_b=lat_b, pe_w=split.pe[:, :D], pe_b=split.pe[:, D],
        kvb_w=kvb_w, kvb_b=kvb_b, o_w=aw.wo.to(w_dtype), o_b=None if aw.bo is None else aw.bo.to(w_dtype),
        inv_freq=plan.inv_freq, scale=scale_tgt, rope_scaling=rope_tgt,
    )


def latent_rows(split: RopeSplit, aw: AttnWeights, beta: float = 1.0, metrics=None,
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """[n + G d, D+1] rows of the untruncated latent [beta K-NoPE; V] (in metric units if given)."""
    k_rows, v_rows = split.nope.to(dtype), augmented(aw.wv, aw.bv, dtype)
    if metrics is not None:  # latent in metric units: PCA then minimises the attention-relevant error
        k_rows, v_rows = metrics[0].to(dtype) @ k_rows, metrics[2].to(dtype) @ v_rows
    return torch.cat([beta * k_rows, v_rows])


def latent_spectrum(latent: torch.Tensor, moment: torch.Tensor) -> torch.Tensor:
    """Descending PCA eigenvalues of the latent under the centred input covariance: the k-th is
    what the k-th kept channel removes from the low-rank step's objective."""
    D = latent.shape[1] - 1
    mom = moment.double()
    mean = mom[:D, D] / mom[D, D]
    cov = mom[:D, :D] / mom[D, D] - torch.outer(mean, mean)
    w = latent[:, :D].double()
    return torch.linalg.eigvalsh(w @ cov @ w.T).flip(0).clamp_min(0)


def top_eigvecs(cov: torch.Tensor, rank: int) -> torch.Tensor:
    """Columns = the `rank` leading eigenvectors of a symmetric PSD matrix (fp64)."""
    evals, evecs = torch.linalg.eigh(cov.double())
    return evecs[:, torch.argsort(evals, descending=True)[:rank]]


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x @ w.to(x.dtype).T
    return y if b is None else y + b.to(x.dtype)


def mla_attention(p: MLAParams, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal MLA attention output [B, T, D] of normed hidden states x [B, T, D] (no latent norm);
    `mask`: a boolean [1, 1, T', T'] (T' >= T, True = attend) instead of plain causal (a sliding window)."""
    B, T, _ = x.shape
    H, dq, _ = p.q_w.shape
    d = p.o_w.shape[1] // H
    q = torch.einsum("btx,hex->bhte", x, p.q_w.to(x.dtype))  # [B, H, T, d+d_r]
    if p.q_b is not None:
        q = q + p.q_b.to(x.dtype)[None, :, None, :]
    c = _linear(x, p.lat_w, p.lat_b)  # [B, T, m]
    kv = torch.einsum("btm,hem->bhte", c, p.kvb_w.to(x.dtype))  # [B, H, T, 2d]
    if p.kvb_b is not None:
        kv = kv + p.kvb_b.to(x.dtype)[None, :, None, :]
    k_pe = _linear(x, p.pe_w, p.pe_b)[:, None]  # [B, 1, T, d_r]
    cos, sin = cos_sin(p.inv_freq, positions, p.rope_scaling)
    q_pe = apply_rope(q[..., d:], cos.to(x.dtype), sin.to(x.dtype))
    k_pe = apply_rope(k_pe, cos.to(x.dtype), sin.to(x.dtype)).expand(B, H, T, -1)
    query = torch.cat([q[..., :d], q_pe], dim=-1)
    key = torch.cat([kv[..., :d], k_pe], dim=-1)
    causal = dict(is_causal=True) if mask is None else dict(attn_mask=mask[..., :T, :T])
    out = sdpa(query, key, kv[..., d:], scale=p.scale, **causal)  # [B, H, T, d]
    return _linear(out.transpose(1, 2).reshape(B, T, H * d), p.o_w, p.o_b)


def to_dtype(p: MLAParams, dtype: torch.dtype) -> MLAParams:
    conv = {f: getattr(p, f) for f in ("q_w", "q_b", "lat_w", "lat_b", "pe_w", "pe_b", "kvb_w", "kvb_b", "o_w", "o_b")}
    return replace(p, **{k: None if v is None else v.to(dtype) for k, v in conv.items()})


def group_weights(aw: AttnWeights, shape: Shape, g: int) -> tuple[AttnWeights, Shape]:
    """KV group g alone (its query heads, key, value and o_proj columns): an attention whose output,
    summed over g, is the layer's. The output bias goes with group 0."""
    per, d = shape.H // shape.G, shape.d
    q_rows, kv_rows = slice(g * per * d, (g + 1) * per * d), slice(g * d, (g + 1) * d)
    pick = lambda b, rows: None if b is None else b[rows]  # noqa: E731
    sub = AttnWeights(aw.wq[q_rows], aw.wk[kv_rows], aw.wv[kv_rows], aw.wo[:, q_rows],
                      pick(aw.bq, q_rows), pick(aw.bk, kv_rows), pick(aw.bv, kv_rows), aw.bo if g == 0 else None)
    return sub, Shape(shape.D, per, 1, d)
def attention_fn(p: MLAParams, positions: torch.Tensor, dev: str, mask: torch.Tensor | None = None):
    """(attention function, its fp32 parameters on `dev`); `mask` as `mla_attention`'s."""
    p32 = on_device(to_dtype(p, torch.float32), dev)
    return (lambda x: mla_attention(p32, x, positions, mask)), p32


def on_device(p: MLAParams, dev: str) -> MLAParams:
    return MLAParams(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in p.__dict__.items()})

