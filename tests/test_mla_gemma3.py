"""Gemma-3 (gemma3_text) -> MLA in the exact `attnkit` format (issue 14): QK-norm per head, sandwich
norms, (1 + w) RMSNorms, scaled embeddings, `query_pre_attn_scalar`, final-logit softcapping, and
sliding-window layers with their own RoPE base, kept as windows (a latent cache that drops old latents)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig
from transformers.cache_utils import DynamicSlidingWindowLayer

from attnkit.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import COMMON, tokenizer  # noqa: E402
from conftest import refused_in_one_line  # noqa: E402

FAST = ["--calib-tokens", "256", "--calib-seq-len", "32", "--eval-tokens", "128"]
G, D_HEAD, WINDOW = 2, 16, 8  # the calibration rows (32 tokens) and the test inputs outrun the window
TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def gemma3(seed: int = 0, **over) -> Gemma3ForCausalLM:
    """A tiny Gemma-3 text model: sliding layers (local base 10k) around a global one (base 1M, linear x4),
    a query scale that is not head_dim, final-logit softcapping, random norm weights (Gemma's are 0 = x1)
    and embeddings large enough that their sqrt(hidden_size) scale matters against the post-norms' outputs."""
    torch.manual_seed(seed)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}}
    cfg = Gemma3TextConfig(**{**COMMON, "num_hidden_layers": len(TYPES), "num_attention_heads": 4,
                              "num_key_value_heads": G, "head_dim": D_HEAD, "sliding_window": WINDOW,
                              "layer_types": TYPES, "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0,
                              "rope_parameters": rope, **over})
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
        model.model.embed_tokens.weight.normal_(0.0, 0.2)
    return model


def _saved(folder: Path, **over) -> Path:
    gemma3(**over).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def _convert(src, out, calib, *extra):
    return main(["convert", "--to", "mla", str(src), "-o", str(out), "--calib", str(calib), *FAST, *extra])


def _logits(path, ids, **kw):
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()(ids).logits


def _rel(a, b):
    return float((a - b).norm() / a.norm())


def _held_out_ppl(path, src, calib, seed=0, **kw) -> float:
    """Perplexity of the model at `path` (transformers) on the converter's held-out rows."""
    from attnkit.converters.common import calibration_tokens

    _, held, _ = calibration_tokens(AutoTokenizer.from_pretrained(src), str(calib), 32, 256, 128, seed)
    logits = _logits(path, held, **kw)[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), held[:, 1:].reshape(-1))
    return float(loss.exp())


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return _saved(tmp_path_factory.mktemp("gemma3") / "src")


@pytest.fixture(scope="module")
def compressed(tmp_path_factory, calib, src):
    """A compressed conversion (d_r 8, r 12 of 64 values) and its printout."""
    out = tmp_path_factory.mktemp("gemma3-mla") / "out"
    assert _convert(src, out, calib, "--rope-dim", "8", "--kv-lora-rank", "12") == 0
    return out


def test_attnkit_format_is_exact_at_full_size(tmp_path, calib, src, capsys):
    out = tmp_path / "out"
    assert _convert(src, out, calib, "--rope-dim", str(G * D_HEAD), "--kv-lora-rank", str(G * D_HEAD), "--dtype", "fp32") == 0
    printed = capsys.readouterr().out
    assert "format attnkit (exact)" in printed and "--format deepseek_v3 is not available" in printed
    assert f"kept as windows of {WINDOW} tokens" in printed
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))  # 40 tokens: 5 windows
    assert _rel(_logits(src, ids), _logits(out, ids, trust_remote_code=True)) < 1e-4
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "attnkit_mla_gemma3_text" and "AutoModelForCausalLM" in cfg["auto_map"]
    assert cfg["layer_types"] == TYPES and cfg["sliding_window"] == WINDOW and cfg["query_pre_attn_scalar"] == 24
    report = json.loads((out / "attnkit_report.json").read_text())
    assert [s["name"] for s in report["steps"]] == ["exact", "rope", "balance", "low-rank", "refit", "native"]
    assert all(s["logits_rel_err_max"] < 1e-4 for s in report["steps"]) and report["lossy_steps"] == []
    assert report["sliding_window"] == {"window": WINDOW, "layers": [0, 2]}
    # the converter streams the source as transformers runs it (scaled embeddings, sandwich and (1 + w)
    # norms, windows, local/global RoPE, softcapped logits): its held-out perplexity is the model's
    assert report["ppl"]["before"] == pytest.approx(_held_out_ppl(src, src, calib), rel=1e-4)


def test_compressed_conversion_reports_every_step_and_measures_what_loads(calib, src, compressed):
    report = json.loads((compressed / "attnkit_report.json").read_text())
    assert [s["name"] for s in report["steps"]] == ["exact", "rope", "balance", "low-rank", "refit", "native"]
    assert report["lossy_steps"] == ["rope", "low-rank"] and report["kv_cache_fraction"] == 20 / 64
    assert report["steps"][0]["logits_rel_err_max"] < 1e-4  # the lifted rewrite alone is exact
    # what the report measured for the written model is what transformers runs
    assert report["ppl"]["after"] == pytest.approx(_held_out_ppl(compressed, src, calib, trust_remote_code=True), rel=1e-4)


def test_absorbed_decode_is_expanded_is_full_forward_past_the_window(compressed):
    from attnkit.adapters.mla import LatentLayer, SlidingLatentLayer, enable_absorbed, is_mla

    model = AutoModelForCausalLM.from_pretrained(compressed, dtype=torch.float32).eval()  # registered by import attnkit
    assert is_mla(model)
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    new = 20  # 26 tokens: the sliding layers drop latents from token 8 on
    with torch.no_grad():
        for mode in ("absorbed", "expanded", "auto"):
            enable_absorbed(model, mode)
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            full = model(out.sequences).logits[:, ids.shape[1] - 1 : -1]
            assert _rel(full, torch.stack(out.logits, 1)) < 1e-5, mode
            layers = out.past_key_values.layers
            assert [type(layer) for layer in layers] == [SlidingLatentLayer, LatentLayer, SlidingLatentLayer]
            total, per_token = out.sequences.shape[1] - 1, 20 * 4  # the last token is never written; r + d_r fp32
            assert [layer.fused().shape[1] for layer in layers] == [WINDOW - 1, total, WINDOW - 1]
            assert [layer.stored_bytes() for layer in layers] == [2 * n * per_token for n in (WINDOW - 1, total, WINDOW - 1)]
        # a chunked prefill past the window: chunks of several tokens see the kept window through the mask
        seq = torch.cat([ids, ids, ids], 1)
        full, cache, steps = model(seq).logits, None, []
        for lo, hi in ((0, 10), (10, 15), (15, 16), (16, 18)):
            step = model(seq[:, lo:hi], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            steps.append(step.logits)
        assert _rel(full, torch.cat(steps, 1)) < 1e-5
        # left padding: the padded row generates what it generates alone
        pad = torch.ones(2, 10, dtype=torch.long)
        pad[0, :4] = 0
        kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
        both = torch.stack(model.generate(seq[:, :10], attention_mask=pad, **kw).logits, 1)
        alone = torch.stack(model.generate(seq[:1, 4:10], **kw).logits, 1)
        assert _rel(alone[0], both[0]) < 1e-5


@settings(max_examples=25, deadline=None)
@given(window=st.integers(2, 12), chunks=st.lists(st.integers(1, 9), min_size=1, max_size=8),
       long_first=st.booleans())
def test_sliding_latent_layer_keeps_what_transformers_window_keeps(window, chunks, long_first):
    """Any window and call sizes: the latent layer returns what transformers' DynamicSlidingWindowLayer
    returns, reports the same mask sizes, and stores only the last window - 1 latents (a long first call's
    buffer is given back)."""
    from attnkit.adapters.mla import _BLOCK, SlidingLatentLayer

    ours, theirs = SlidingLatentLayer(sliding_window=window), DynamicSlidingWindowLayer(sliding_window=window)
    gen, rank, rope = torch.Generator().manual_seed(window), 3, 2
    for n in ([600] if long_first else []) + chunks:
        c, pe = torch.randn(1, 1, n, rank, generator=gen), torch.randn(1, 1, n, rope, generator=gen)
        assert ours.get_mask_sizes(n) == theirs.get_mask_sizes(n)
        got_c, got_pe = ours.update(c, pe)
        want_c, want_pe = theirs.update(c, pe)
        assert torch.equal(got_c, want_c) and torch.equal(got_pe, want_pe)
        assert torch.equal(ours.attended(), torch.cat([want_c[:, 0], want_pe[:, 0]], -1))
        assert ours.get_seq_length() == theirs.get_seq_length()
        kept = min(ours.get_seq_length(), window - 1)
        assert ours.fused().shape[1] == kept and ours.stored_bytes() == kept * (rank + rope) * 4
        assert torch.equal(ours.fused(), torch.cat([theirs.keys[:, 0], theirs.values[:, 0]], -1))
        assert ours.allocated_bytes() <= (window - 1 + 2 * _BLOCK) * (rank + rope) * 4


@settings(max_examples=8, deadline=None)
@given(kv_heads=st.sampled_from([1, 2]), per_group=st.sampled_from([1, 2]), half=st.sampled_from([2, 4]),
       scalar=st.sampled_from([None, 7, 64]), sliding=st.booleans())
def test_lifted_gemma3_layer_is_the_source_attention(kv_heads, per_group, half, scalar, sliding):
    """Any shape, query scale and layer type: the exact stage on the lifted input, written in the attnkit
    format, is Gemma-3's attention (its own RoPE tables and, for a sliding layer, the window's mask)."""
    from attnkit.adapters.families import FAMILIES
    from attnkit.converters.mla import layer as mla
    from attnkit.converters.mla.layer import AttnWeights, Shape
    from attnkit.converters.mla.qknorm import attnkit_config, attnkit_module, attnkit_tensors, lifted_view
    from attnkit.converters.mla.rope import source_rope
    from attnkit.converters.mla.source import window_mask

    d, H, T = 2 * half, kv_heads * per_group, 11
    kind = "sliding_attention" if sliding else "full_attention"
    model = gemma3(num_attention_heads=H, num_key_value_heads=kv_heads, head_dim=d, num_hidden_layers=1,
                   layer_types=[kind], query_pre_attn_scalar=scalar or d)
    attn, fam = model.model.layers[0].self_attn, FAMILIES["gemma3_text"]
    aw = AttnWeights(attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach(),
                     attn.o_proj.weight.detach())
    shape = Shape(model.config.hidden_size, H, kv_heads, d)
    view = lifted_view(attn, aw, shape, fam.qk_norm)
    x = torch.randn(2, T, shape.D)
    aug = torch.cat([view.attn_input(x), torch.ones(2, T, 1)], -1).reshape(-1, view.shape.D + 1).double()
    src_inv, att = source_rope(fam, model.config, kind)
    plan = mla.identity_plan(view.shape, src_inv)
    scale = attn.scaling
    assert scale == pytest.approx((scalar or d) ** -0.5)
    p = mla.build_stage(view.aw, plan, view.shape, aug.T @ aug / aug.shape[0], scale_src=scale, scale_tgt=scale,
                        rope_src=att, rope_tgt=att, rank=2 * kv_heads * d - plan.d_r)
    config = attnkit_config(model.config, fam, 2 * kv_heads * d - plan.d_r, plan.kept_i.tolist())
    module = attnkit_module(config, 0, attnkit_tensors(mla.to_dtype(p, torch.float32), shape, attn), "cpu")
    assert module.scaling == scale and module.sliding_window == (WINDOW if sliding else None)
    pe = model.model.rotary_emb(x, torch.arange(T)[None], kind)
    mask = window_mask(T, WINDOW if sliding else None, "cpu")
    assert (mask is not None) == sliding
    with torch.no_grad():
        want = attn(x, position_embeddings=pe, attention_mask=mask)[0]
        got = module(x, position_embeddings=pe, attention_mask=mask)[0]
        stage = mla.attention_fn(p, torch.arange(T), "cpu", mask)[0](view.attn_input(x))
    assert _rel(want, got) < 1e-4 and _rel(want, stage) < 1e-4


def test_deepseek_v3_format_is_refused_in_one_line(tmp_path, calib, src, capsys):
    refused_in_one_line(lambda: _convert(src, tmp_path / "out", calib, "--format", "deepseek_v3"), capsys,
                        tmp_path / "out", "gemma3_text", "sandwich norms", "sliding-window", "--format attnkit")


def test_multimodal_gemma3_is_refused_in_one_line(tmp_path, calib, capsys):
    folder = tmp_path / "gemma3-vision"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3",
                                                    "architectures": ["Gemma3ForConditionalGeneration"]}))
    refused_in_one_line(lambda: _convert(folder, tmp_path / "out", calib), capsys, tmp_path / "out",
                        "multimodal", "Gemma3ForConditionalGeneration", "gemma3_text")


@pytest.mark.parametrize("config, words", [
    ({"model_type": "gemma2"}, "softcapping"),
    ({"model_type": "gemma3"}, "multimodal"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attention-logit softcapping"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "bidirectional"),
    ({"model_type": "gemma3_text", "rope_parameters": {
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "sequence length"),
])
def test_what_is_not_converted_is_refused_with_the_reason(config, words):
    from attnkit.converters.families import describe
    from attnkit.errors import AttnkitError

    with pytest.raises(AttnkitError, match=words):
        describe(config)


def test_gemma3_text_with_windows_and_old_rope_fields_is_accepted():
    from attnkit.converters.families import describe

    old = {"model_type": "gemma3_text", "sliding_window": 512, "max_position_embeddings": 32768,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1e6, "rope_local_base_freq": 1e4}
    assert describe(old).model_type == "gemma3_text"


def test_without_trust_remote_code_transformers_says_so(tmp_path, compressed):
    code = f"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({str(compressed)!r})"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode != 0 and "trust_remote_code=True" in run.stderr


def test_kv_budget_is_refused_for_rope_per_layer_type(tmp_path, capsys):
    """Gemma-3's RoPE and windows follow its layer types; the candidate evaluator does not: one line."""
    src = _saved(tmp_path / "src")
    refused_in_one_line(lambda: main(["convert", "--to", "mla", str(src), "-o", str(tmp_path / "out"), "--kv-budget", "0.3"]),
                        capsys, tmp_path / "out", "--kv-budget", "per layer type")
