"""DIFF retrofit: exactness at step 0 on every family, what the ramp switches on, CLI, KV cache."""

from __future__ import annotations

import json

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dex_models import FAMILIES, convert_cli, retrofit_pair, save_tiny_model, set_step, write_calib

from attnkit.adapters.diff import DiffCombine
from attnkit.converters.diff.layer import head_rms, norm_weights


@settings(max_examples=6, deadline=None)
@given(
    family=st.sampled_from(FAMILIES),
    heads_kv=st.sampled_from([(4, 1), (4, 2), (2, 2)]),
    layers=st.integers(1, 2),
    seq=st.integers(1, 9),
    seed=st.integers(0, 1000),
)
def test_diff_is_exact_at_step_0(family, heads_kv, layers, seq, seed):
    heads, kv = heads_kv
    source, diff = retrofit_pair(family, "diff", seed, heads=heads, kv_heads=kv, layers=layers, hidden=8 * heads)
    gen = torch.Generator().manual_seed(seed)
    for module in diff.modules():  # a trained-looking second query: still exact while the ramp is 0
        if hasattr(module, "diff_q_proj"):
            torch.nn.init.normal_(module.diff_q_proj.weight, generator=gen)
    ids = torch.randint(0, 300, (2, seq), generator=gen)
    with torch.no_grad():
        assert torch.equal(source(input_ids=ids).logits, diff(input_ids=ids).logits)
        set_step(diff, 100, 100)
        moved = diff(input_ids=ids).logits
    assert torch.isfinite(moved).all() and not torch.allclose(source(input_ids=ids).logits, moved)


def test_diff_combine_formula():
    torch.manual_seed(0)
    comb = DiffCombine(num_heads=3, head_dim=4, layer_idx=2)
    o1, o2 = torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3, 4)  # [B, T, H, d]
    assert torch.equal(comb(o1, o2), o1)  # ramp 0
    comb.attnkit_set_step(1, 1)  # ramp 1: the paper's form
    lam = torch.exp((comb.lambda_q1 * comb.lambda_k1).sum()) - torch.exp((comb.lambda_q2 * comb.lambda_k2).sum()) + comb.lambda_init
    diff = o1 - lam * o2
    expected = diff / diff.pow(2).mean(-1, keepdim=True).add(comb.eps).sqrt() * comb.norm_weight * (1 - comb.lambda_init)
    assert torch.allclose(comb(o1, o2), expected, atol=1e-6)


def test_zero_second_query_is_the_uniform_causal_map():
    """A2 starts as the mean of the visible values: the common-mode the subtraction removes."""
    _, diff = retrofit_pair("llama", "diff", 2, layers=1)
    attn = diff.model.layers[0].self_attn
    captured = {}
    attn.diff.register_forward_hook(lambda m, inp, out: captured.update(o2=inp[1]))
    attn.v_proj.register_forward_hook(lambda m, inp, out: captured.update(v=out))
    with torch.no_grad():
        diff(input_ids=torch.randint(0, 300, (1, 6)))
    v = captured["v"].view(1, 6, 2, 8)  # [B, T, G, d]; 4 query heads share 2 KV heads
    mean_v = v.cumsum(1) / torch.arange(1, 7).view(1, 6, 1, 1)
    assert torch.allclose(captured["o2"], mean_v.repeat_interleave(2, dim=2), atol=1e-6)


def test_norm_weight_init_matches_head_scale():
    out = torch.randn(3, 7, 2, 4) * torch.tensor([1.0, 5.0]).view(1, 1, 2, 1)  # [B, T, H, d]
    total, count = head_rms(out)
    w = norm_weights(total / count, layer_idx=0, head_dim=4)
    assert w.shape == (2, 4)
    assert torch.allclose(w[:, 0] * (1 - 0.2), (total / count).float())
    assert w[1, 0] > 4 * w[0, 0]


def test_convert_diff_cli_keeps_the_cache(tmp_path):
    calib = write_calib(tmp_path / "calib")
    src = save_tiny_model(tmp_path / "src", "mistral")
    out = tmp_path / "out"
    assert convert_cli("diff", src, out, calib, "--dtype", "bf16") == 0
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["method"] == "diff" and report["steps"][0]["exact"] is True
    assert report["kv_cache_bytes_per_token"]["before"] == report["kv_cache_bytes_per_token"]["after"]
    assert report["output_dtype"] == "bfloat16"
    assert len(report["diff"]["head_output_rms"]) == 2 and "heads" not in report
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "attnkit_mistral" and config["attnkit"]["method"] == "diff"
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        names = list(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.diff_q_proj.weight").dtype == torch.bfloat16
        assert not f.get_tensor("model.layers.0.self_attn.diff_q_proj.weight").any()
    assert sum(".diff." in n for n in names) == 2 * 8  # 4 λ vectors, norm, 3 buffers per layer
