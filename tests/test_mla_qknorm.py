"""QK-norm sources -> MLA: the exact `attnkit` format and the folded DeepSeek-V3 export (issue 14)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, Olmo2Config, Olmo2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from attnkit.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import COMMON, tokenizer  # noqa: E402
from conftest import refused_in_one_line  # noqa: E402

FAST = ["--calib-tokens", "256", "--calib-seq-len", "32", "--eval-tokens", "128"]
G, D_HEAD = 2, 16


def qwen3(seed: int = 0, kind: str = "qwen3", **over) -> Qwen3ForCausalLM:
    """A tiny Qwen3 (or OLMo-2) with random norm weights (transformers initialises them to ones)."""
    torch.manual_seed(seed)
    config_class, model_class = (Qwen3Config, Qwen3ForCausalLM) if kind == "qwen3" else (Olmo2Config, Olmo2ForCausalLM)
    cfg = config_class(**{**COMMON, "num_attention_heads": 4, "num_key_value_heads": G, "head_dim": D_HEAD, **over})
    model = model_class(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return _saved(tmp_path_factory.mktemp("qwen3") / "src", "qwen3")


def _convert(src, out, calib, *extra):
    return main(["convert", "--to", "mla", str(src), "-o", str(out), "--calib", str(calib), *FAST, *extra])


def _logits(path, ids, **kw):
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()(ids).logits


def _rel(a, b):
    return float((a - b).norm() / a.norm())


def _saved(folder: Path, kind: str) -> Path:
    qwen3(kind=kind).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["qwen3", "olmo2"])
def test_attnkit_format_is_exact_at_full_size_and_says_why(tmp_path, calib, kind, capsys):
    src, out = _saved(tmp_path / "src", kind), tmp_path / "out"
    assert _convert(src, out, calib, "--rope-dim", str(G * D_HEAD), "--kv-lora-rank", str(G * D_HEAD), "--dtype", "fp32") == 0
    printed = capsys.readouterr().out
    assert "format attnkit (exact)" in printed and "trust_remote_code" in printed
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    assert _rel(_logits(src, ids), _logits(out, ids, trust_remote_code=True)) < 1e-4
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == f"attnkit_mla_{kind}" and "AutoModelForCausalLM" in cfg["auto_map"]
    assert (out / "modeling_attnkit_mla.py").is_file() and (out / "mla.py").is_file()
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["target"]["format"] == "attnkit" and report["load"]["trust_remote_code"] is True
    assert [s["name"] for s in report["steps"]] == ["exact", "rope", "balance", "low-rank", "refit", "native"]
    assert all(s["logits_rel_err_max"] < 1e-4 for s in report["steps"]) and report["lossy_steps"] == []
    assert report["kv_cache_fraction"] == 1.0


def test_compressed_attnkit_format_decodes_absorbed_like_expanded(tmp_path, calib, src):
    from attnkit.adapters.mla import enable_absorbed, is_mla

    out = tmp_path / "out"
    assert _convert(src, out, calib, "--rope-dim", "8", "--kv-lora-rank", "12") == 0
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["lossy_steps"] == ["rope", "low-rank"] and report["kv_cache_fraction"] == 20 / 64
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # registered by import attnkit
    assert is_mla(model)
    ids = torch.randint(3, 100, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        for mode in ("absorbed", "expanded", "auto"):
            enable_absorbed(model, mode)
            prefix = model(ids[:, :20], use_cache=True)
            cache, steps = prefix.past_key_values, [prefix.logits]
            for t in range(20, 24):  # token by token through the latent cache
                step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
                cache = step.past_key_values
                steps.append(step.logits)
            assert _rel(full, torch.cat(steps, 1)) < 1e-5, mode
            assert cache.layers[0].fused().shape[-1] == 20  # r + d_r per token


def test_deepseek_v3_format_folds_the_norms_measured_and_loads_natively(tmp_path, calib, src, capsys):
    out = tmp_path / "out"
    assert _convert(src, out, calib, "--format", "deepseek_v3", "--target", "transformers",
                    "--rope-dim", str(G * D_HEAD), "--kv-lora-rank", str(G * D_HEAD + 1), "--dtype", "fp32") == 0
    printed = capsys.readouterr().out
    assert "QK-norm fold (lossy" in printed
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["lossy_steps"] == ["exact"] and report["steps"][0]["exact"] is False
    assert report["qk_norm_fold"]["kl"] == report["steps"][0]["kl"] > 0
    assert len(report["layers"][0]["qk_norm_fold_scale"]) == 4
    # full size: the rest is exact, so the output's loss is the fold's alone
    assert abs(report["steps"][-1]["kl"] - report["steps"][0]["kl"]) < 1e-3 * report["steps"][0]["kl"] + 1e-9
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and "auto_map" not in cfg
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    _logits(out, ids)  # loads with no remote code


def test_fold_is_exact_when_the_norms_are_constant_scales():
    """Keys and queries of constant RMS per head: the norm is a constant scale and the fold finds it."""
    from attnkit.converters.mla.qknorm import fold_scales
    from attnkit.converters.mla.rope import cos_sin

    torch.manual_seed(0)
    q = torch.randn(2, 9, 4, 8)
    k = torch.randn(2, 9, 2, 8)
    q_hat = 3.0 * q / q.norm(dim=-1, keepdim=True)
    k_hat = 0.5 * k / k.norm(dim=-1, keepdim=True)
    cos, sin = cos_sin(torch.rand(4), torch.arange(9))
    gamma = fold_scales(q_hat, k_hat, q_hat * 2.0, k_hat, cos, sin, torch.tensor([0, 0, 1, 1]))
    assert torch.allclose(gamma, torch.full((4,), 0.5))


def test_fold_keeps_the_norm_weight_at_its_own_scale():
    """The folded maps are W·w (not W·w/1000 with γ 10⁶x): keys and queries keep trainable scales."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from attnkit.converters.mla.qknorm import norm_weight

    norm = Qwen3RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    assert torch.allclose(norm_weight(norm, 8), norm.weight.detach(), rtol=1e-6)


def test_llama_attnkit_format_is_the_deepseek_v3_one(tmp_path, calib):
    from mla_fixtures import save_model

    llama = save_model(tmp_path / "llama", "llama")
    assert _convert(llama, tmp_path / "a", calib, "--format", "attnkit", "--rope-dim", "16", "--kv-lora-rank", "17") == 0
    assert json.loads((tmp_path / "a" / "config.json").read_text())["model_type"] == "deepseek_v3"


def test_olmo2_as_deepseek_v3_is_refused_in_one_line(tmp_path, calib, capsys):
    src = _saved(tmp_path / "src", "olmo2")
    refused_in_one_line(lambda: _convert(src, tmp_path / "out", calib, "--format", "deepseek_v3"), capsys,
                        tmp_path / "out", "post-norm", "--format attnkit")


@pytest.mark.parametrize("extra, words", [
    (["--v-head-dim", "32"], "--v-head-dim is not available with --format attnkit"),
    (["--rope-frequencies", "ladder"], "--format attnkit rotates the shared RoPE key"),
    (["--kv-lora-rank", "33", "--rope-dim", "32"], "--kv-lora-rank must be in 2..32"),
])
def test_bad_attnkit_settings_are_one_line(tmp_path, calib, src, capsys, extra, words):
    refused_in_one_line(lambda: _convert(src, tmp_path / "out", calib, *extra), capsys, tmp_path / "out", words)


def test_without_trust_remote_code_transformers_says_so(tmp_path, calib, src):
    out = tmp_path / "out"
    assert _convert(src, out, calib, "--rope-dim", "8", "--kv-lora-rank", "12") == 0
    code = f"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({str(out)!r})"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode != 0 and "trust_remote_code=True" in run.stderr


@settings(max_examples=6, deadline=None)
@given(kv_heads=st.sampled_from([1, 2]), per_group=st.sampled_from([1, 2, 3]), half=st.sampled_from([2, 4]))
def test_lifted_layer_is_the_source_attention(kv_heads, per_group, half):
    """Any shape: the exact stage on the lifted input, written in the attnkit format, is the source layer."""
    from attnkit.converters.mla import layer as mla
    from attnkit.converters.mla.qknorm import attnkit_config, attnkit_module, attnkit_tensors, lifted_view
    from attnkit.converters.mla.layer import AttnWeights, Shape
    from attnkit.converters.mla.rope import source_rope
    from attnkit.adapters.families import FAMILIES

    d, H = 2 * half, kv_heads * per_group
    model = qwen3(num_attention_heads=H, num_key_value_heads=kv_heads, head_dim=d, num_hidden_layers=1)
    attn, fam = model.model.layers[0].self_attn, FAMILIES["qwen3"]
    aw = AttnWeights(attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach(),
                     attn.o_proj.weight.detach())
    shape = Shape(model.config.hidden_size, H, kv_heads, d)
    view = lifted_view(attn, aw, shape, fam.qk_norm)
    x = torch.randn(2, 7, shape.D)
    y = view.attn_input(x)  # [B, T, (H + 2G) d]
    aug = torch.cat([y, torch.ones(2, 7, 1)], -1).reshape(-1, view.shape.D + 1).double()
    mom = aug.T @ aug / aug.shape[0]
    src_inv, att = source_rope(fam, model.config)
    plan = mla.identity_plan(view.shape, src_inv)
    scale = d ** -0.5
    p = mla.build_stage(view.aw, plan, view.shape, mom, scale_src=scale, scale_tgt=scale, rope_src=att, rope_tgt=att,
                        rank=2 * kv_heads * d - plan.d_r)
    pairs = plan.kept_i.tolist()
    module = attnkit_module(attnkit_config(model.config, fam, 2 * kv_heads * d - plan.d_r, pairs), 0,
                            attnkit_tensors(mla.to_dtype(p, torch.float32), shape, attn), "cpu")
    pe = model.model.rotary_emb(x, torch.arange(7)[None])
    with torch.no_grad():
        want = attn(x, position_embeddings=pe, attention_mask=None)[0]
        got = module(x, position_embeddings=pe)[0]
    assert _rel(want, got) < 1e-4


def test_bundled_model_words_resolve_or_say_how_to_build(tmp_path, monkeypatch):
    from attnkit.errors import AttnkitError
    from attnkit.io import resolve

    monkeypatch.setattr(resolve, "ASSETS", tmp_path)
    with pytest.raises(AttnkitError, match="recipes/reference-qwen3.yaml"):
        resolve.resolve_model("reference-qwen3")
    (tmp_path / "reference-qwen3").mkdir()
    (tmp_path / "reference-qwen3" / "config.json").write_text("{}")
    assert resolve.resolve_model("reference-qwen3") == tmp_path / "reference-qwen3"


@pytest.mark.parametrize("kind", ["qwen3", "olmo2"])
def test_kv_budget_chooses_an_attnkit_split_on_the_lifted_view(tmp_path, calib, kind):
    """--kv-budget with the attnkit format: candidates built on the normed keys (the converter's own
    view), the latent counted without a norm channel; the choice converts to the same tensors when
    named explicitly."""
    from safetensors.torch import load_file

    src = _saved(tmp_path / "src", kind)
    out, explicit = tmp_path / "out", tmp_path / "explicit"
    assert _convert(src, out, calib, "--kv-budget", "0.5") == 0
    report = json.loads((out / "attnkit_report.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    chosen, total = report["kv_budget"]["chosen"], report["kv_budget"]["values_per_token_layer"]
    assert total == G * D_HEAD  # half of 2 G d
    assert chosen["kv_lora_rank"] + chosen["rope_dim"] <= total and len(report["kv_budget"]["candidates"]) >= 3
    assert "auto_map" in cfg  # the attnkit format
    assert (cfg["attnkit"]["kv_lora_rank"], 2 * len(cfg["attnkit"]["rope_pairs"])) == (chosen["kv_lora_rank"], chosen["rope_dim"])
    from attnkit.converters.mla.budget import preferred

    best = preferred(report["kv_budget"]["candidates"])[0]
    assert (best["kv_lora_rank"], best["rope_dim"]) == (chosen["kv_lora_rank"], chosen["rope_dim"])
    assert _convert(src, explicit, calib, "--kv-lora-rank", str(chosen["kv_lora_rank"]), "--rope-dim",
                    str(chosen["rope_dim"])) == 0
    a, b = load_file(next(out.glob("*layers*.safetensors"))), load_file(next(explicit.glob("*layers*.safetensors")))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fold_bound_script_scalings():
    """benchmarks/qknorm_fold_bound.py: `exact` is the norm itself; with one KV head and ε = 0 the latent
    scaling is the per-head norm again (its factor is 1/RMS(k) exactly), values untouched."""
    from conftest import load_benchmark

    fb = load_benchmark("qknorm_fold_bound.py", "bench_qknorm_fold_bound")
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    k, v = torch.randn(2, 5, 8) * 3, torch.randn(2, 5, 8)  # [B, T, G d] with G = 1
    box = {"calib_f": fb.latent_factor(k, v, 0.0, torch.tensor(1.0))[..., None]}
    keep = torch.ones(8, dtype=torch.bool)
    x = k.unflatten(-1, (1, 8))
    torch.testing.assert_close(fb.Side(norm, x, "exact", box, keep)(x), norm(x))
    key_proj = fb.KeyProj(lambda _: k, lambda _: v, 0.0, torch.tensor(1.0), box)
    key_proj(None)
    torch.testing.assert_close(fb.Side(norm, x, "latent", box, keep)(x), norm(x), rtol=1e-5, atol=1e-5)
    values = fb.ValueScaled(lambda _: v, box["calib_f"].mean(), box)(None)
    inv_rms = 1 / k.pow(2).mean(-1, keepdim=True).sqrt()  # [B, T, 1]
    torch.testing.assert_close(values, v * inv_rms / inv_rms.mean())  # values scaled as the latent is
    const = fb.Side(norm, x, "const", box, keep)(x)
    assert not torch.allclose(const, norm(x), rtol=1e-3)  # a constant cannot follow the per-token RMS
    assert fb.rope_keep(8, 1).tolist() == [False, True, True, True, False, True, True, True]
