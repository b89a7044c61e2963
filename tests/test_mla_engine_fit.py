"""The engine form's per-layer fit (`attnkit/converters/mla/engine_fit.py`): its choices (the anchor's ratio,
the latent mix) are judged on calibration rows held aside, not on the rows they were fitted on."""

import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attnkit.cli import main
from attnkit.converters.mla import engine_fit
from attnkit.converters.mla.engine_fit import Held, Judged, fit_moment
from attnkit.converters.mla.engines import KvbRefit
from attnkit.converters.mla.source import Moment
from attnkit.converters.stream.rowstore import RowStore

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import calib_folder, save_model  # noqa: E402


def test_every_eighth_row_is_held_and_none_below_eight():
    assert Held(7).rows == [] and not any(Held(7)(i) for i in range(7))
    assert Held(8).rows == [7]
    assert Held(20).rows == [7, 15] and [i for i in range(20) if Held(20)(i)] == [7, 15]


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 20), T=st.integers(1, 6), D=st.integers(1, 6), seed=st.integers(0, 99))
def test_fit_moment_is_the_moment_of_the_rows_not_held(tmp_path_factory, rows, T, D, seed):
    torch.manual_seed(seed)
    h = RowStore(tmp_path_factory.mktemp("rows") / "h.bin", rows, (T, D))
    h.write(0, torch.randn(rows, T, D) * 3 + 1)
    norm = torch.nn.RMSNorm(D)
    every, fit = Moment(D), Moment(D)
    held = Held(rows)
    with torch.no_grad():
        for i in range(rows):
            x = norm(h.read(i, i + 1))
            every.add(x)
            if not held(i):
                fit.add(x)
    assert torch.allclose(fit_moment(every.value, norm, h, held, "cpu"), fit.value, rtol=1e-10, atol=1e-12)
    h.close()


def test_a_merged_refit_is_the_refit_over_both_sets_of_rows():
    torch.manual_seed(0)
    m, kvb_w = 4, torch.randn(3, 6, 4)
    a, b, both = KvbRefit(m), KvbRefit(m), KvbRefit(m)
    for refit in (a, b):
        c, n = torch.randn(50, m), torch.randn(50, m + 1)
        refit.add(c, n)
        both.add(c, n)
    assert torch.allclose(a.merged(b).solve(kvb_w), both.solve(kvb_w), rtol=1e-10, atol=1e-12)


def test_judged_in_sample_when_nothing_is_held():
    j = Judged(3, Held(4))
    assert j.judge is j.fit and j.part(True) is j.fit


@pytest.fixture(scope="module")
def few_directions(tmp_path_factory):
    """One random Llama layer of width 64 calibrated on 256 tokens of a 100-token vocabulary: its first layer
    sees one input per distinct token, fewer directions than it is wide, so the in-sample steadiest direction
    is one that held-out text moves along."""
    root = tmp_path_factory.mktemp("few")
    return root, calib_folder(root / "calib"), save_model(root / "src", "llama", num_hidden_layers=1)


def _layer0(root: Path, calib: Path, src: Path, name: str) -> dict:
    out = root / name
    assert main(["convert", "--to", "mla", str(src), "-o", str(out), "--calib", str(calib), "--calib-tokens", "256",
                 "--calib-seq-len", "16", "--eval-tokens", "256", "--rope-dim", "8", "--kv-lora-rank", "25",
                 "--report", "final"]) == 0
    return json.loads((out / "attnkit_report.json").read_text())["layers"][0]


def test_the_anchor_chosen_on_held_rows_keeps_held_out_text_right(few_directions, monkeypatch):
    held = _layer0(*few_directions, "held")
    monkeypatch.setattr(engine_fit, "HOLD_EVERY", 10**9)  # every row fits and judges: the choice in-sample
    in_sample = _layer0(*few_directions, "in-sample")
    assert held["held_rows"] == 2 and in_sample["held_rows"] == 0
    # in-sample the largest anchor looks best on the rows it was fitted on, and breaks held-out text
    assert in_sample["anchor_ratio"] == 8.0
    err = lambda layer: layer["attn_rel_err_mean"]["native"]  # noqa: E731
    assert err(held) < 0.5 * err(in_sample), (err(held), err(in_sample))
    # the held rows see what the fit rows do not: the ratio in-sample judged best is the worst there
    by_ratio = held["kv_refit_rel_err_by_ratio"]
    assert by_ratio["8.0"] == max(by_ratio.values()) and held["anchor_ratio"] != 8.0
