"""`--fit-steps` (attnkit.converters.mla.fit): the fit lowers a lossy layer's error, never writes a layer it
made worse, leaves an exact conversion exact, and is reported per layer."""

import json
import sys
from pathlib import Path
from unittest import mock

import torch
from hypothesis import given, settings, strategies as st

from attnkit.cli import main
from attnkit.converters.mla import fit
from attnkit.converters.stream.rowstore import RowStore

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import logits_rel, save_model  # noqa: E402
from conftest import refused_in_one_line  # noqa: E402

FAST = ["--calib-tokens", "512", "--calib-seq-len", "32", "--eval-tokens", "128"]


def _rows(tmp_path, n=8, T=6, D=5, seed=0) -> RowStore:
    torch.manual_seed(seed)
    return RowStore.from_tensor(tmp_path / "rows.f32", torch.randn(n, T, D))


def _pair(D=5, seed=0):
    """A source map x -> tanh(x A) and a linear student started near it: a lossy 'conversion'."""
    torch.manual_seed(seed)
    a = torch.randn(D, D)
    student = torch.nn.Linear(D, D, bias=False)
    with torch.no_grad():
        student.weight.copy_(a.T + 0.3 * torch.randn(D, D))
    return student, (lambda x: torch.tanh(x @ a))


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 50), steps=st.sampled_from([20, 60]))
def test_fit_lowers_the_error_of_a_lossy_layer(tmp_path_factory, seed, steps):
    tmp = tmp_path_factory.mktemp("fit")
    student, source = _pair(seed=seed)
    r = fit.fit_attention(student, student, source, lambda x: x, _rows(tmp, seed=seed), steps, 3e-2, "cpu")
    assert r.kept == "fitted" and r.steps == steps
    assert r.rel_err_after < r.rel_err_before
    assert not any(p.requires_grad for p in student.parameters())


def test_a_fit_that_ends_worse_is_not_kept(tmp_path):
    student, source = _pair()
    start = student.weight.detach().clone()
    r = fit.fit_attention(student, student, source, lambda x: x, _rows(tmp_path), 10, 1e4, "cpu")  # diverges
    assert r.kept == "start" and r.rel_err_after == r.rel_err_before
    assert torch.equal(student.weight, start)


def test_a_fit_that_ends_worse_is_restored_from_the_given_start(tmp_path):
    """`start=`: the caller's (bf16) tensors, not a copy of the fp32 layer, are what an undone fit restores."""
    student, source = _pair()
    with torch.no_grad():
        student.weight.copy_(student.weight.to(torch.bfloat16).float())  # a layer loaded from bf16 tensors
    read = []

    class Written(dict):
        def __getitem__(self, name):
            read.append(name)
            return super().__getitem__(name)
    written = Written(weight=student.weight.detach().to(torch.bfloat16))
    r = fit.fit_attention(student, student, source, lambda x: x, _rows(tmp_path), 10, 1e4, "cpu", start=written)
    assert r.kept == "start" and read == ["weight"]
    assert student.weight.dtype == torch.float32 and torch.equal(student.weight, written["weight"].float())


class _CausalAttention(torch.nn.Module):
    """Softmax attention over the rows' own earlier positions: rows interact through nothing but the loss."""

    def __init__(self, D: int, H: int, bias: bool):
        super().__init__()
        self.H = H
        self.qkv = torch.nn.Linear(D, 3 * D, bias=bias)
        self.o = torch.nn.Linear(D, D, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, D // self.H).permute(2, 0, 3, 1, 4)  # each [B, H, T, d]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(B, T, D))


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 5), T=st.integers(1, 9), H=st.sampled_from([1, 2, 4]), d=st.sampled_from([2, 4, 8]),
       bias=st.booleans(), per=st.integers(1, 6), seed=st.integers(0, 1000))
def test_the_chunked_gradient_is_the_batch_gradient(rows, T, H, d, bias, per, seed):
    """backward_by_rows accumulates the gradient of the batch's relative error while the layer only ever
    sees chunks of `per` rows (CHUNK_VALUES, what bounds the fit's activations)."""
    torch.manual_seed(seed)
    layer = _CausalAttention(H * d, H, bias).double()
    x, target = torch.randn(rows, T, H * d, dtype=torch.float64), torch.randn(rows, T, H * d, dtype=torch.float64)
    fit.rel_err(layer(x), target).backward()
    whole = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    seen = []

    def attend(batch: torch.Tensor) -> torch.Tensor:
        seen.append(batch.shape[0])
        return layer(batch)
    with mock.patch.object(fit, "CHUNK_VALUES", per * T * H * d):
        fit.backward_by_rows(attend, x, target)
        with torch.no_grad():
            torch.testing.assert_close(fit.by_rows(layer, x), layer(x), rtol=1e-10, atol=1e-12)
    assert seen == [per] * (rows // per) + ([rows % per] if rows % per else [])
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, whole[n], rtol=1e-10, atol=1e-12)


def test_chunks_are_whole_batches_on_small_layers_and_rows_on_wide_ones():
    """The reference's 4 x 1,024-token batch (D 256) is one chunk, as before chunking; the 1B shape's (D 2,048)
    and the 8B shape's (D 4,096) go a row at a time."""
    assert fit.row_chunks(torch.empty(4, 1024, 256)) == [slice(0, 8)]
    assert fit.row_chunks(torch.empty(4, 1024, 2048)) == [slice(i, i + 1) for i in range(4)]
    assert fit.row_chunks(torch.empty(3, 1024, 4096)) == [slice(i, i + 1) for i in range(3)]


def test_an_exact_layer_is_not_fitted(tmp_path):
    student, _ = _pair()
    start = student.weight.detach().clone()
    r = fit.fit_attention(student, student, lambda x: x @ start.T, lambda x: x, _rows(tmp_path), 10, 1e-2, "cpu")
    assert r.kept == "exact" and r.steps == 0 and torch.equal(student.weight, start)


@settings(max_examples=20, deadline=None)
@given(steps=st.integers(1, 500), lr=st.floats(1e-5, 1.0))
def test_schedule_warms_up_then_decays_to_zero(steps, lr):
    rates = [fit.lr_at(k, steps, lr) for k in range(steps)]
    assert all(0 < r <= lr * (1 + 1e-9) for r in rates)
    if steps >= 20:
        assert rates[-1] < 0.05 * lr and max(rates) > 0.99 * lr
    peak = rates.index(max(rates))
    assert all(a >= b - 1e-12 for a, b in zip(rates[peak:], rates[peak + 1:]))  # non-increasing after the peak


def test_batches_cycle_through_every_row(tmp_path):
    rows = _rows(tmp_path, n=6)
    batch = fit._batches(rows, 4)
    everything = rows.read(0, 6)
    assert torch.equal(batch(0), everything[:4])
    assert torch.equal(batch(1), torch.cat([everything[4:], everything[:2]]))


def _convert(src, out, calib, *extra) -> dict:
    assert main(["convert", "--to", "mla", str(src), "-o", str(out), "--calib", str(calib), *FAST, *extra]) == 0
    return json.loads((out / "attnkit_report.json").read_text())


def test_fitted_conversion_has_a_lower_one_shot_loss(tmp_path, calib):
    src = save_model(tmp_path / "src", "qwen2")  # biases: the engine form drops them, the fit compensates
    lossy = ["--kv-lora-rank", "9", "--rope-dim", "8", "--report", "final"]
    plain = _convert(src, tmp_path / "plain", calib, *lossy)
    fitted = _convert(src, tmp_path / "fit", calib, *lossy, "--fit-steps", "40", "--fit-lr", "3e-3")
    assert fitted["steps"][-1]["alone"] == "fitted" and "--fit-steps" not in plain["steps"][-1]["what"]
    assert fitted["settings"]["fit_steps"] == 40 and plain["settings"]["fit_steps"] == 0
    records = [layer["fit"] for layer in fitted["layers"]]
    assert all(r["rel_err_after"] <= r["rel_err_before"] for r in records)
    assert any(r["kept"] == "fitted" for r in records)
    assert fitted["steps"][-1]["kl"] < plain["steps"][-1]["kl"]
    assert logits_rel(src, tmp_path / "fit") < logits_rel(src, tmp_path / "plain")


def test_full_size_stays_exact_with_the_fit_on(tmp_path, calib):
    src = save_model(tmp_path / "src", "llama")
    report = _convert(src, tmp_path / "out", calib, "--rope-dim", "32", "--kv-lora-rank", "33", "--target",
                      "transformers", "--fit-steps", "20")
    assert all(layer["fit"]["kept"] == "exact" for layer in report["layers"])
    assert logits_rel(src, tmp_path / "out") < 1e-4


def test_bad_fit_settings_are_refused_in_one_line(tmp_path, calib, capsys):
    src = save_model(tmp_path / "src", "llama")
    for bad in (["--fit-steps", "-1"], ["--fit-steps", "5", "--fit-lr", "0"]):
        run = lambda: main(["convert", "--to", "mla", str(src), "-o", str(tmp_path / "out"), "--calib", str(calib),  # noqa: E731
                            *FAST, *bad])
        refused_in_one_line(run, capsys, tmp_path / "out", "--fit-steps", "--fit-lr")


def test_the_fit_calibrates_on_the_healing_rows_by_default():
    """--calib-seq-len defaults to 512, and to the healing recipes' row length where the layer fit runs
    (fitted on 512-token rows, a layer is fitted for 512 tokens of reach; the heal and attnkit-ppl use 1024)."""
    import yaml
    from attnkit.cli import build_parser
    from attnkit.converters.options import CALIB_SEQ_LEN, FIT_SEQ_LEN, calib_seq_len

    def parsed(to, *extra):
        return build_parser().parse_args(["convert", "--to", to, "model", "-o", "out", *extra])
    recipe = yaml.safe_load((Path(__file__).parents[1] / "recipes" / "heal-mla.yaml").read_text())
    assert FIT_SEQ_LEN == recipe["data"]["seq_len"] and CALIB_SEQ_LEN == 512
    assert calib_seq_len(parsed("mla")) == CALIB_SEQ_LEN
    assert calib_seq_len(parsed("mla", "--fit-steps", "10")) == FIT_SEQ_LEN
    assert calib_seq_len(parsed("mla+dex", "--fit-steps", "10")) == FIT_SEQ_LEN
    assert calib_seq_len(parsed("mla", "--fit-steps", "10", "--calib-seq-len", "256")) == 256
    for to in ("dex", "diff", "gqa", "titans"):
        assert calib_seq_len(parsed(to)) == CALIB_SEQ_LEN
    # the settings of a caller that skips `attnkit convert`'s dispatch (the benchmarks' `candidates.prepare`)
    from attnkit.converters.common import stream_fields
    assert stream_fields(parsed("mla"), torch.bfloat16)["seq_len"] == CALIB_SEQ_LEN
    assert stream_fields(parsed("mla", "--fit-steps", "10"), torch.bfloat16)["seq_len"] == FIT_SEQ_LEN


def test_a_fitted_conversion_reads_rows_of_the_fit_length(tmp_path, calib):
    src = save_model(tmp_path / "src", "llama")
    out = tmp_path / "out"
    assert main(["convert", "--to", "mla", str(src), "-o", str(out), "--calib", str(calib), "--calib-tokens", "2048",
                 "--eval-tokens", "1024", "--kv-lora-rank", "9", "--rope-dim", "8", "--report", "final",
                 "--fit-steps", "2"]) == 0
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["settings"]["seq_len"] == 1024 and report["calibration"]["seq_len"] == 1024
    assert report["calibration"]["calib_rows"] == 2
