"""Least-squares refit of the MLA query's NoPE projection to the keys the converted layer has.

Head h's NoPE score in the target is q'_h . k'_h with k'_h the key rebuilt from the (truncated)
latent; in the source the same key components carried RoPE: q_h^T R(-Delta w) k_h for a key
Delta positions back (rotate-half pairs (i, i + d/2), R a 2x2 rotation per pair). Treating the
query input, the key input and Delta as independent, with Delta drawn from a per-head weight
w_h(Delta) (the source's attention mass at that distance, or uniform over causal pairs),

    min_{q' = T q}  E[(q'^T k' - q^T R(-Delta w) k)^2]   gives   T_h = C'^+ E[k' k^T] Rbar_h^T,

with C' = E[k' k'^T], Rbar_h = E_w[R(-Delta w)] = [[c, s], [-s, c]] per pair, c = E cos(Delta w_i),
s = E sin(Delta w_i), moments uncentred (E over x~ = [x; 1]; the key means matter once rotated).

Two facts decide what this buys:
* The low-rank part is a no-op for attnkit's latent: `build_stage` keeps the top eigenvectors P of
  the latent's own activation covariance (whatever metric/balancing maps it first), so P P^T z is
  the least-squares predictor of z from the cached latent and so is every linear function of it,
  k'_h included; the residual k - k' is uncorrelated with k', E[k' k^T] = C' and T = I on range(C').
* What remains is Rbar: each NoPE'd frequency pair of the query is rotated and damped by the mean
  rotation of that frequency over the distances the head attends to (high frequencies average out).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from attnkit.converters.mla.layer import AttnWeights, MLAParams, RopePlan, Shape, augmented, split_keys
from attnkit.converters.mla.rope import apply_rope, cos_sin
from attnkit.converters.mla.source import Source, source_scale


def rope_stage_keys(aw: AttnWeights, plan: RopePlan, shape: Shape) -> torch.Tensor:
    """[G, d, D+1] augmented NoPE key rows of every KV group before any truncation (fp64); query
    head h scores against group h // (H / G)."""
    split = split_keys(aw, plan, shape)
    return torch.einsum("gdn,na->gda", split.back, split.nope)


def _head_keys(p: MLAParams, lat: torch.Tensor, h: int) -> torch.Tensor:
    """[d, D+1] augmented NoPE key rows of head h in stage p (lat = [lat_w | lat_b], fp64)."""
    d = p.o_w.shape[1] // p.q_w.shape[0]
    keys = p.kvb_w[h, :d].double() @ lat
    if p.kvb_b is not None:
        keys[:, -1] += p.kvb_b[h, :d].double()
    return keys


def stage_keys(p: MLAParams) -> torch.Tensor:
    """[H, d, D+1] augmented NoPE key rows a stage really computes (latent -> kv_b_proj K rows)."""
    lat = augmented(p.lat_w, p.lat_b)  # [m, D+1]
    return torch.stack([_head_keys(p, lat, h) for h in range(p.q_w.shape[0])])


def causal_attention_by_distance(aw: AttnWeights, shape: Shape, x: torch.Tensor, inv_freq: torch.Tensor,
                                 rope_scaling: float, scale: float, window: int | None = None) -> torch.Tensor:
    """w_h(Delta) [H, T]: the source's attention probability at distance Delta, averaged over queries.

    x [B, T, D] are the layer's normed inputs. Each query's probabilities sum to one, so each row does.
    `window`: a sliding-window layer's (keys at Delta >= window are not seen).
    """
    B, T, _ = x.shape
    H, G, d = shape.H, shape.G, shape.d
    x = torch.cat([x.double(), torch.ones(B, T, 1, dtype=torch.float64)], -1)  # [B, T, D+1]
    q = (x @ augmented(aw.wq, aw.bq).T).view(B, T, H, d)
    k = (x @ augmented(aw.wk, aw.bk).T).view(B, T, G, d)
    cos, sin = cos_sin(inv_freq, torch.arange(T), rope_scaling)  # [T, d]
    q = apply_rope(q.transpose(1, 2), cos.double(), sin.double())  # [B, H, T, d]
    k = apply_rope(k.transpose(1, 2), cos.double(), sin.double())[:, shape.group]  # [B, H, T, d]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    if window is not None:  # keys a sliding window has left behind are masked like future ones
        future |= torch.tril(torch.ones(T, T, dtype=torch.bool), -window)
    delta = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp_min(0).flatten()  # t - s (future: 0, p = 0)
    weights = torch.zeros(H, T, dtype=torch.float64)
    for h in range(H):  # one head at a time: [B, T, T] temporaries only (a 32-head layer at T 512 would need 67 MB each)
        scores = (q[:, h] @ k[:, h].transpose(-1, -2)) * scale  # [B, T(query), T(key)]
        probs = scores.masked_fill(future, float("-inf")).softmax(-1).sum(0)  # [T, T]
        weights[h].index_add_(0, delta, probs.flatten())
    return weights / (B * T)


def uniform_distance_weights(T: int, H: int, window: int | None = None) -> torch.Tensor:
    """w(Delta) [H, T] of a uniform draw over the causal pairs of a T-token window: (T - Delta) / #pairs
    (pairs at Delta >= `window` excluded for a sliding-window layer)."""
    w = T - torch.arange(T, dtype=torch.float64)
    if window is not None:
        w[window:] = 0
    return (w / w.sum()).expand(H, T).clone()


def mean_rotation(weights: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E cos(Delta w_i), E sin(Delta w_i)), each [H, d/2], under the per-head distance weights [H, T]."""
    angle = torch.arange(weights.shape[1], dtype=torch.float64)[:, None] * inv_freq.double()[None, :]  # [T, d/2]
    return weights.double() @ angle.cos(), weights.double() @ angle.sin()


def _pinv_psd(c: torch.Tensor, rcond: float = 1e-10) -> torch.Tensor:
    """Pseudo-inverse of a batch of symmetric PSD matrices, eigenvalues below rcond * max dropped."""
    evals, evecs = torch.linalg.eigh(c)
    keep = evals > rcond * evals.amax(-1, keepdim=True).clamp_min(1e-300)
    inv = torch.where(keep, 1.0 / evals.clamp_min(1e-300), torch.zeros_like(evals))
    return (evecs * inv[..., None, :]) @ evecs.transpose(-1, -2)


def query_maps(new_keys: torch.Tensor, ref_keys: torch.Tensor, moment: torch.Tensor,
               mean_cos: torch.Tensor | None = None, mean_sin: torch.Tensor | None = None) -> torch.Tensor:
    """T_h = C'^+ E[k' k^T] Rbar_h^T, [H, d, d], from augmented key rows [H, d, D+1] and E[x~ x~^T].

    Without mean_cos/mean_sin, Rbar = I (match the untruncated NoPE keys, no RoPE memory)."""
    mom = moment.double()
    c_new = new_keys @ mom @ new_keys.transpose(1, 2)  # [H, d, d]
    cross = new_keys @ mom @ ref_keys.transpose(1, 2)  # E[k' k^T]
    t = _pinv_psd(c_new) @ cross
    if mean_cos is None:
        return t
    # (X Rbar^T) row-wise: each row's pair [a, b] -> [c a + s b, -s a + c b], a rotation by -angle
    cos = torch.cat([mean_cos, mean_cos], -1).double()[:, None, :]  # [H, 1, d]
    sin = torch.cat([mean_sin, mean_sin], -1).double()[:, None, :]
    return apply_rope(t, cos, -sin)


def refit_query(p: MLAParams, ref_keys: torch.Tensor, moment: torch.Tensor,
                mean_cos: torch.Tensor | None = None, mean_sin: torch.Tensor | None = None) -> MLAParams:
    """`p` with each head's NoPE query rows (and bias) replaced by T_h q_h (see `query_maps`).

    ref_keys [G or H, d, D+1] (`rope_stage_keys`); computed head by head ([d, D+1] temporaries)."""
    H = p.q_w.shape[0]
    d = p.o_w.shape[1] // H
    lat, mom, per = augmented(p.lat_w, p.lat_b), moment.double(), H // ref_keys.shape[0]
    t = torch.empty(H, d, d, dtype=torch.float64)
    for h in range(H):
        rot = (None, None) if mean_cos is None else (mean_cos[h : h + 1], mean_sin[h : h + 1])
        t[h] = query_maps(_head_keys(p, lat, h)[None], ref_keys[h // per][None], mom, *rot)[0]
    t = t.to(p.q_w.dtype)
    q_w = p.q_w.clone()
    q_w[:, :d] = t @ p.q_w[:, :d]  # [H, d, d] @ [H, d, D]
    q_b = p.q_b
    if q_b is not None:
        q_b = q_b.clone()
        q_b[:, :d] = (t @ p.q_b[:, :d, None])[..., 0]
    return replace(p, q_w=q_w, q_b=q_b)


# ---------------------------------------------------------------- the converter's `refit` stage

REFIT_ROWS = 4  # calibration rows whose source attention gives the refit's distance weights


def distance_weights(mode: str, aw: AttnWeights, src: Source, x: torch.Tensor, src_inv: torch.Tensor,
                     src_att: float, window: int | None = None) -> torch.Tensor:
    """[H, T] distance weights of the query refit, averaged over the rows of x [B, T, D]."""
    if mode == "uniform":
        return uniform_distance_weights(x.shape[1], src.shape.H, window)
    per_row = [causal_attention_by_distance(aw, src.shape, row[None].cpu(), src_inv, src_att, source_scale(src), window)
               for row in x]
    return torch.stack(per_row).mean(0)


def rope_damping(weights: torch.Tensor, src_inv: torch.Tensor) -> torch.Tensor:
    """[H, d/2] 1 - |E_w R(-Delta w_i)|^2 of each head's distance weights [H, T]: how much of pair i's
    rotation the refit cannot keep once the pair is NoPE'd (0: the rotation is the same at every
    distance the head attends to; 1: it averages out completely). Half the refit's mean squared
    rotation error E|R - Rbar|^2 = 2 (1 - |Rbar|^2)."""
    c, s = mean_rotation(weights, src_inv)
    return (1.0 - c * c - s * s).clamp_min(0.0)


def layer_damping(s, aw: AttnWeights, src: Source, first_rows: Callable[[], torch.Tensor],
                  rope: tuple[torch.Tensor, float], window: int | None = None) -> torch.Tensor | None:
    """A layer's `rope_damping` under the refit's own distance weights when `--rope-score loss` ranks
    the RoPE components (`layer.loss_scores`); None (nothing computed) when key energy ranks them.
    `first_rows()`: the math's input [B, T, D] on the first REFIT_ROWS calibration rows; `rope`: the
    layer's (inv_freq, attention scaling)."""
    if s.rope_score != "loss":
        return None
    src_inv, src_att = rope
    with torch.no_grad():
        x = first_rows()
    return rope_damping(distance_weights(s.refit_query, aw, src, x, src_inv, src_att, window), src_inv)


def refit_params(p: MLAParams, aw: AttnWeights, plan: RopePlan, src: Source, mom: torch.Tensor,
                 weights: torch.Tensor, src_inv: torch.Tensor) -> MLAParams:
    return refit_query(p, rope_stage_keys(aw, plan, src.shape), mom, *mean_rotation(weights, src_inv))
