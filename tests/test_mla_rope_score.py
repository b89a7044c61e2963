"""RoPE components ranked by their loss after the query refit (`--rope-score loss`): the damping is
what the refit cannot keep of a rotation, a component whose rotation the refit keeps is NoPE'd
first, and the defaults and refusals of the flag."""

import argparse

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attnkit.cli import main
from attnkit.converters.mla import layer as mla
from attnkit.converters.mla import refit
from attnkit.converters.mla.settings import rope_score_for
from attnkit.errors import AttnkitError

from conftest import refused_in_one_line
from mla_fixtures import save_model


def _inv(d: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))


@settings(max_examples=10, deadline=None)
@given(H=st.integers(1, 4), T=st.integers(1, 40), d=st.sampled_from([2, 4, 8]), seed=st.integers(0, 999))
def test_damping_is_one_minus_the_mean_rotation_squared(H, T, d, seed):
    """1 - |E_w exp(i Delta w_i)|^2 computed with complex numbers; 0 when a head attends at Delta = 0 only."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(H, T, generator=gen, dtype=torch.float64)
    w = w / w.sum(1, keepdim=True)
    inv = _inv(d)
    phase = torch.exp(1j * torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :])  # [T, d/2]
    expect = 1.0 - ((w.to(phase.dtype) @ phase).abs() ** 2)
    got = refit.rope_damping(w, inv)
    assert got.shape == (H, d // 2)
    assert torch.allclose(got, expect.real.clamp_min(0), atol=1e-12)
    at_zero = torch.zeros(H, T, dtype=torch.float64)
    at_zero[:, 0] = 1
    assert float(refit.rope_damping(at_zero, inv).abs().max()) < 1e-12


def _layer(G=2, groups=2, d=8, D=24, seed=0):
    torch.manual_seed(seed)
    H = G * groups
    aw = mla.AttnWeights(torch.randn(H * d, D), torch.randn(G * d, D), torch.randn(G * d, D), torch.randn(D, H * d))
    x = torch.randn(64, D)
    flat = torch.cat([x, torch.ones(64, 1)], 1).double()
    return aw, mla.Shape(D, H, G, d), flat.T @ flat / 64


def test_a_component_whose_rotation_the_refit_keeps_is_nopeed_first():
    """Pair 0 has by far the most key energy; with its rotation constant over the distances every
    head attends to (damping 0), the loss score drops it, the energy score keeps it."""
    aw, shape, mom = _layer()
    G, d, half = shape.G, shape.d, shape.d // 2
    k = aw.wk.view(G, d, -1)
    k[:, 0] *= 20
    k[:, half] *= 20  # both halves of frequency pair 0 (rotate-half layout)
    damping = torch.ones(shape.H, half, dtype=torch.float64)
    damping[:, 0] = 0
    inv, d_r = _inv(d), 4
    energy = mla.plan_rope(aw, mom, shape, d_r, "rorope", inv)
    loss = mla.plan_rope(aw, mom, shape, d_r, "rorope", inv, damping=damping)
    assert 0 in energy.kept_i.tolist() and 0 not in loss.kept_i.tolist()
    assert len(loss.kept_i) == len(energy.kept_i) == d_r // 2
    # with a uniform damping the loss score is the key energy times the query energy it meets
    _, e = mla.rope_scores(aw, mom, shape, "rorope")
    _, l1 = mla.rope_scores(aw, mom, shape, "rorope", torch.ones(shape.H, half, dtype=torch.float64))
    assert torch.equal((l1 > 0), (e > 0)) and not torch.allclose(l1 / l1.sum(), e / e.sum())


@settings(max_examples=6, deadline=None)
@given(G=st.sampled_from([1, 2, 4]), groups=st.sampled_from([1, 2]), d=st.sampled_from([4, 8]),
       seed=st.integers(0, 99))
def test_loss_score_is_linear_in_each_heads_damping(G, groups, d, seed):
    """score(i, j) = energy_ij * sum_h U_i[j, g(h)]^2 E|q_hi|^2 damping_hi: doubling one head's damping
    adds exactly that head's term."""
    aw, shape, mom = _layer(G, groups, d, seed=seed)
    half = d // 2
    gen = torch.Generator().manual_seed(seed)
    base = torch.rand(shape.H, half, generator=gen, dtype=torch.float64)
    _, s0 = mla.rope_scores(aw, mom, shape, "rorope", base)
    more = base.clone()
    more[0] *= 2
    only = torch.zeros_like(base)
    only[0] = base[0]
    _, s1 = mla.rope_scores(aw, mom, shape, "rorope", more)
    _, s_only = mla.rope_scores(aw, mom, shape, "rorope", only)
    assert torch.allclose(s1, s0 + s_only, rtol=1e-10, atol=1e-12)


def test_defaults_and_refusals():
    assert rope_score_for(None, "rorope", "exact", "attention") == "loss"
    assert rope_score_for(None, "rorope", "ladder", "attention") == "energy"
    assert rope_score_for(None, "rorope", "exact", "off") == "energy"
    assert rope_score_for(None, "partial", "exact", "attention") == "energy"
    assert rope_score_for("loss", "rorope", "ladder", "uniform") == "loss"
    for method, refit_mode in (("partial", "attention"), ("rorope", "off")):
        with pytest.raises(AttnkitError, match="--rope-score loss"):
            rope_score_for("loss", method, "exact", refit_mode)


@pytest.mark.parametrize("flags", [["--rope-method", "partial"], ["--no-refit-query"]])
def test_loss_score_without_what_it_needs_is_refused(tmp_path, capsys, flags):
    src = save_model(tmp_path / "src", "llama")
    out = tmp_path / "out"
    refused_in_one_line(lambda: main(["convert", "--to", "mla", str(src), "-o", str(out), "--rope-score", "loss",
                                      "--target", "transformers", *flags]), capsys, out, "--rope-score loss")
