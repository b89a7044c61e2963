"""Query least-squares refit (attnkit.converters.mla.refit): exact where it must be, and it lowers
the score error it minimises on the calibration data."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attnkit.converters.mla import layer as mla
from attnkit.converters.mla import refit
from attnkit.converters.mla.rope import apply_rope


def _layer(G, groups, d, bias, seed, T=12, B=2, D=32):
    torch.manual_seed(seed)
    H = G * groups
    std = 0.3
    aw = mla.AttnWeights(torch.randn(H * d, D) * std, torch.randn(G * d, D) * std, torch.randn(G * d, D) * std,
                         torch.randn(D, H * d) * std,
                         *((torch.randn(H * d), torch.randn(G * d), torch.randn(G * d), torch.randn(D)) if bias
                           else (None,) * 4))
    x = torch.randn(B, T, D) + 0.5  # a non-zero mean, so the uncentred moments matter
    flat = torch.cat([x.reshape(-1, D), torch.ones(B * T, 1)], 1).double()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    return aw, mla.Shape(D, H, G, d), x, flat, flat.T @ flat / (B * T), inv


def _stage(aw, shape, mom, inv, d_r, rank, objective="attention"):
    plan = mla.plan_rope(aw, mom, shape, d_r, "rorope", inv)
    split = mla.split_keys(aw, plan, shape)
    metrics = mla.attention_metrics(aw, split, shape, mom) if objective == "attention" else None
    beta = mla.balance_factor(split, aw, mom, metrics)
    kw = dict(scale_src=shape.d**-0.5, scale_tgt=(shape.d + d_r) ** -0.5, beta=beta, metrics=metrics, rank=rank)
    return plan, mla.build_stage(aw, plan, shape, mom, **kw)


def _out(p, x):
    with torch.no_grad():
        return mla.mla_attention(mla.to_dtype(p, torch.float32), x, torch.arange(x.shape[1]))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@settings(max_examples=6, deadline=None)
@given(G=st.sampled_from([1, 2]), groups=st.sampled_from([1, 2]), d=st.sampled_from([4, 8]), bias=st.booleans(),
       seed=st.integers(0, 99), low=st.booleans(), objective=st.sampled_from(["kv", "attention"]))
def test_refit_to_untruncated_keys_is_a_no_op_for_the_pca_latent(G, groups, d, bias, seed, low, objective):
    """Full rank: nothing to fix. Low rank: the PCA reconstruction is already the least-squares
    predictor of every key from the latent, so T_h = I on the keys' range (logits unchanged)."""
    aw, shape, x, _, mom, inv = _layer(G, groups, d, bias, seed)
    d_r = max(2, G * d // 2)
    full = 2 * G * d - d_r
    plan, p = _stage(aw, shape, mom, inv, d_r, max(1, full // 3) if low else full, objective)
    after = refit.refit_query(p, refit.rope_stage_keys(aw, plan, shape), mom)
    assert _rel(_out(after, x), _out(p, x)) < 1e-5


@settings(max_examples=3, deadline=None)
@given(G=st.sampled_from([1, 2]), d=st.sampled_from([4, 8]), bias=st.booleans(), seed=st.integers(0, 99))
def test_full_size_refit_with_rope_memory_changes_nothing(G, d, bias, seed):
    """d_r = G d: no key component lost RoPE, so the NoPE query is unused and the output is unchanged."""
    aw, shape, x, _, mom, inv = _layer(G, 2, d, bias, seed)
    plan, p = _stage(aw, shape, mom, inv, G * d, G * d + 1)
    w = refit.causal_attention_by_distance(aw, shape, x, inv, 1.0, d**-0.5)
    after = refit.refit_query(p, refit.rope_stage_keys(aw, plan, shape), mom, *refit.mean_rotation(w, inv))
    assert _rel(_out(after, x), _out(p, x)) < 1e-5


def _score_error(p, p_ref_q, ref_keys, flat, w, inv, d):
    """E over (query sample, key sample, Delta ~ w_h) of (q'.k' - q^T R(-Delta w) k)^2, brute force."""
    q_new = torch.einsum("na,hea->hne", flat, torch.cat([p.q_w[:, :d], p.q_b[:, :d, None]], -1)
                         if p.q_b is not None else torch.cat([p.q_w[:, :d], torch.zeros_like(p.q_w[:, :d, :1])], -1))
    q_src = torch.einsum("na,hea->hne", flat, p_ref_q)
    k_new = torch.einsum("na,hea->hne", flat, refit.stage_keys(p))
    k_src = torch.einsum("na,hea->hne", flat, ref_keys.repeat_interleave(p.q_w.shape[0] // ref_keys.shape[0], 0))
    s_new = q_new @ k_new.transpose(1, 2)  # [H, N, N]
    ang = torch.arange(w.shape[1], dtype=torch.float64)[:, None] * inv  # [Delta, d/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)  # [Delta, d]
    rk = apply_rope(k_src[:, None], cos[:, None], -sin[:, None])  # R(-Delta w) k: [H, Delta, N, d]
    err = ((s_new[:, None] - q_src[:, None] @ rk.transpose(-1, -2)) ** 2).mean((-1, -2))  # [H, Delta]
    return float((w * err).sum())


def _aug_q(p, d):
    b = p.q_b[:, :d, None] if p.q_b is not None else torch.zeros_like(p.q_w[:, :d, :1])
    return torch.cat([p.q_w[:, :d], b], -1).double()


@settings(max_examples=6, deadline=None)
@given(G=st.sampled_from([1, 2]), d=st.sampled_from([4, 8]), bias=st.booleans(), seed=st.integers(0, 99),
       uniform=st.booleans())
def test_refit_lowers_its_score_error_on_calibration_data(G, d, bias, seed, uniform):
    aw, shape, x, flat, mom, inv = _layer(G, 2, d, bias, seed)
    d_r = max(2, G * d // 2)
    plan, p = _stage(aw, shape, mom, inv, d_r, max(1, (2 * G * d - d_r) // 3))
    w = (refit.uniform_distance_weights(x.shape[1], shape.H) if uniform
         else refit.causal_attention_by_distance(aw, shape, x, inv, 1.0, d**-0.5))
    assert torch.allclose(w.sum(1), torch.ones(shape.H, dtype=torch.float64))
    ref = refit.rope_stage_keys(aw, plan, shape)
    after = refit.refit_query(p, ref, mom, *refit.mean_rotation(w, inv))
    err = lambda s: _score_error(s, _aug_q(p, d), ref, flat, w, inv, d)  # noqa: E731
    after_err = err(after)
    assert after_err < err(p) * (1 - 1e-4)
    # it is the minimiser: any small change of the refit query rows makes the error larger
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        nudge = 1e-3 * torch.randn(p.q_w[:, :d].shape, generator=gen, dtype=torch.float64)
        q_w = after.q_w.clone()
        q_w[:, :d] += nudge * after.q_w[:, :d].abs().mean()
        assert err(mla.MLAParams(**{**after.__dict__, "q_w": q_w})) > after_err


def test_refit_fixes_a_latent_that_is_not_a_least_squares_reconstruction():
    """A random (non-PCA) latent basis: the C'^+ E[k' k^T] part does real work and lowers the error."""
    aw, shape, x, flat, mom, inv = _layer(2, 2, 8, True, 3)
    plan, p = _stage(aw, shape, mom, inv, 8, None)  # untruncated latent [n + G d rows]
    basis = torch.linalg.qr(torch.randn(p.lat_w.shape[0], 6, dtype=torch.float64))[0]
    bad = mla.MLAParams(**{**p.__dict__, "lat_w": basis.T @ p.lat_w, "lat_b": basis.T @ p.lat_b,
                           "kvb_w": p.kvb_w @ basis})
    ref = refit.rope_stage_keys(aw, plan, shape)
    w = torch.zeros(shape.H, x.shape[1], dtype=torch.float64)
    w[:, 0] = 1.0  # Rbar = I: only the truncation is corrected
    after = refit.refit_query(bad, ref, mom)
    assert _score_error(after, _aug_q(bad, 8), ref, flat, w, inv, 8) < 0.9 * _score_error(bad, _aug_q(bad, 8), ref, flat, w, inv, 8)


@pytest.mark.slow
def test_conversion_has_a_refit_stage_by_default_and_not_with_no_refit_query(tmp_path):
    import json
    import sys
    from pathlib import Path

    from attnkit.cli import main

    sys.path.insert(0, str(Path(__file__).parent))
    from mla_fixtures import calib_folder, save_model

    src, calib = save_model(tmp_path / "src", "qwen2"), calib_folder(tmp_path / "calib")  # query bias too
    fast = ["--calib", str(calib), "--calib-tokens", "256", "--calib-seq-len", "32", "--eval-tokens", "128",
            "--kv-lora-rank", "20", "--rope-dim", "16"]
    steps = {}
    for flag in ("--refit-query", "--no-refit-query"):
        assert main(["convert", "--to", "mla", str(src), "-o", str(tmp_path / flag), *fast, flag]) == 0
        report = json.loads((tmp_path / flag / "attnkit_report.json").read_text())
        steps[flag] = {s["name"]: s for s in report["steps"]}
        assert report["settings"]["refit_query"] == ("attention" if flag == "--refit-query" else "off")
    assert list(steps["--refit-query"]) == ["exact", "rope", "balance", "low-rank", "refit", "native"]
    assert list(steps["--no-refit-query"]) == ["exact", "rope", "balance", "low-rank", "native"]
    # same calibration, same latent: the stages before the refit are identical
    assert steps["--refit-query"]["low-rank"]["kl"] == steps["--no-refit-query"]["low-rank"]["kl"]
    assert steps["--refit-query"]["refit"]["kl"] != steps["--refit-query"]["low-rank"]["kl"]
