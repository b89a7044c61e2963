"""The retrofits' calibration pass (`converters/calibration.py`): the same statistics as eager attention's
probabilities give, a block of query rows at a time, with no graph, and a peak that does not grow with
the calibration sequence length."""

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.converters import calibration
from attnkit.converters.dex.heads import normalized_entropy
from attnkit.converters.diff.layer import head_rms
from attnkit.evaluation.peak import run_with_peak

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import calib_folder, family_model, save_model  # noqa: E402


def _eager_stats(model, rows: torch.Tensor) -> dict:
    """The statistics from eager attention's full [B, H, T, T] probabilities (the reference)."""
    model.set_attn_implementation("eager")
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    ent = [0.0] * layers
    rms = [0.0] * layers
    n_ent, n_rms = [0] * layers, [0] * layers
    hooks = []
    for attn in (m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")):
        def on_attn(module, _i, out):
            s, n = normalized_entropy(out[1])
            ent[module.layer_idx] = ent[module.layer_idx] + s
            n_ent[module.layer_idx] += n

        def on_o(layer):
            def hook(_m, inputs):
                s, n = head_rms(inputs[0].view(*inputs[0].shape[:-1], heads, -1))
                rms[layer] = rms[layer] + s
                n_rms[layer] += n
            return hook

        hooks += [attn.register_forward_hook(on_attn), attn.o_proj.register_forward_pre_hook(on_o(attn.layer_idx))]
    with torch.no_grad():
        logits = model(input_ids=rows, use_cache=False).logits
    for h in hooks:
        h.remove()
    return {"entropy": torch.stack([e / n for e, n in zip(ent, n_ent)]).float(),
            "head_rms": torch.stack([r / n for r, n in zip(rms, n_rms)]).float(), "logits": logits}


@settings(max_examples=12, deadline=None)
@given(kind=st.sampled_from(["llama", "mistral", "qwen2", "mha", "mqa"]), seq=st.integers(2, 40),
       block_rows=st.integers(1, 9), window=st.sampled_from([None, 5]))
def test_block_statistics_equal_eager(kind, seq, block_rows, window):
    over = {"sliding_window": window} if kind == "mistral" else {}
    model, _ = family_model(kind, **over)
    rows = torch.randint(0, 100, (3, seq), generator=torch.Generator().manual_seed(seq))
    want = _eager_stats(model, rows)
    heads = model.config.num_attention_heads
    old = calibration.BLOCK_BYTES
    calibration.BLOCK_BYTES = 4 * 3 * heads * seq * block_rows  # `block_rows` query rows per block
    seen = []
    add = calibration.EntropyStats.add
    try:
        calibration.EntropyStats.add = lambda self, layer, probs, first: (seen.append(probs.shape[2]),
                                                                          add(self, layer, probs, first))
        got = calibration.calibrate(model, rows, torch.device("cpu"), tokens_per_batch=3 * seq)  # one batch of 3
    finally:
        calibration.BLOCK_BYTES = old
        calibration.EntropyStats.add = add
    assert max(seen) == min(block_rows, seq)  # never more than one block of rows at a time
    assert torch.allclose(got["entropy"], want["entropy"], rtol=1e-5, atol=1e-6)
    assert torch.allclose(got["head_rms"], want["head_rms"], rtol=1e-5, atol=1e-7)
    assert model.config._attn_implementation == "eager"  # restored


def test_calibration_keeps_no_graph():
    model, _ = family_model("llama")
    rows = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    stats = calibration.calibrate(model, rows, torch.device("cpu"))
    assert all(not v.requires_grad and v.grad_fn is None for v in stats.values())


@pytest.mark.slow
def test_retrofit_peak_does_not_grow_with_calibration_length(tmp_path):
    """Eager probabilities at T = 2048 (batches of 2 x 8 heads x 2048 x 2048: 268 MB per layer in fp32, their
    fp64 entropy temporaries twice that each, and before the fix a graph holding every layer's) add well over
    a gigabyte to T = 256; one block of query rows adds nothing but noise (peaks of 665-739 MB at T = 256,
    1024 and 2048 on one machine, in no order)."""
    calib = calib_folder(tmp_path / "calib")
    src = save_model(tmp_path / "src", "llama", num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=4096)
    peaks = {}
    for seq in (256, 2048):
        samples = []
        for i in range(2):  # the lower of two: one run's RSS noise cannot fail the bound
            code, peak, err = run_with_peak(["convert", "--to", "dex", str(src), "-o", str(tmp_path / f"o{seq}-{i}"),
                                             "--calib", str(calib), "--calib-tokens", "8192", "--calib-seq-len",
                                             str(seq)], env={"TQDM_DISABLE": "1"})
            assert code == 0, err
            samples.append(peak)
        peaks[seq] = min(samples)
    assert peaks[2048] - peaks[256] < 300e6, peaks
