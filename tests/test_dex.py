"""DEX: head selection rule, exactness at step 0 on every family, annealing, CLI, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dex_models import calib, FAMILIES, convert_cli, retrofit_pair, save_tiny_model, set_step  # noqa: F401 (calib: fixture)

from attnkit.adapters.dex import anneal_ramp, lambda_init_for_layer
from attnkit.converters.dex.heads import normalized_entropy, parse_heads, select_heads
from attnkit.errors import AttnkitError


# ------------------------------------------------------------------ pure functions


def test_parse_heads_rules():
    assert parse_heads("auto", 0.5) == ("auto", 0.5)
    assert parse_heads("all", 0.5) == ("all", 1.0)
    assert parse_heads("0.25", 0.5) == ("auto", 0.25)
    assert parse_heads("1", 0.5) == ("auto", 1.0)


@pytest.mark.parametrize("bad", ["best", "0", "-0.5", "1.5", "nan", ""])
def test_parse_heads_refuses(bad):
    with pytest.raises(AttnkitError):
        parse_heads(bad, 0.5)


def test_parse_heads_refuses_bad_auto_fraction():
    with pytest.raises(AttnkitError, match=r"\(0, 1\]"):
        parse_heads("auto", 0.0)


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(1, 4), heads=st.integers(1, 12), fraction=st.floats(0.01, 1.0), seed=st.integers(0, 99))
def test_select_heads_takes_the_highest_scores(layers, heads, fraction, seed):
    scores = torch.rand(layers, heads, generator=torch.Generator().manual_seed(seed))
    selected = select_heads(scores, "auto", fraction)
    k = max(1, math.ceil(fraction * heads - 1e-9))
    for row, chosen in zip(scores, selected):
        assert len(chosen) == k and chosen == sorted(chosen)
        rest = [h for h in range(heads) if h not in chosen]
        if rest:
            assert min(float(row[h]) for h in chosen) >= max(float(row[h]) for h in rest)
    assert select_heads(scores, "all", 1.0) == [list(range(heads))] * layers


def test_normalized_entropy_uniform_and_peaked():
    t = 6
    causal = torch.tril(torch.ones(t, t))
    uniform = (causal / causal.sum(-1, keepdim=True))[None, None].expand(2, 3, t, t)  # [B, H, T, T]
    total, count = normalized_entropy(uniform)
    assert torch.allclose(total / count, torch.ones(3, dtype=torch.float64))
    peaked = torch.eye(t)[None, None].expand(1, 2, t, t)  # each query attends to itself only
    total, count = normalized_entropy(peaked)
    assert torch.allclose(total / count, torch.zeros(2, dtype=torch.float64))


def test_lambda_schedule_and_ramp():
    assert lambda_init_for_layer(0) == pytest.approx(0.2)
    assert lambda_init_for_layer(100) == pytest.approx(0.8)
    assert anneal_ramp(0, 100, 0.25) == 0.0
    assert anneal_ramp(10, 100, 0.25) == pytest.approx(0.4)
    assert anneal_ramp(25, 100, 0.25) == 1.0 and anneal_ramp(90, 100, 0.25) == 1.0


# ------------------------------------------------------------------ exactness at step 0


@settings(max_examples=6, deadline=None)
@given(
    family=st.sampled_from(FAMILIES),
    heads_kv=st.sampled_from([(4, 1), (4, 2), (4, 4), (2, 2)]),
    layers=st.integers(1, 2),
    seq=st.integers(1, 9),
    seed=st.integers(0, 1000),
)
def test_dex_is_exact_at_step_0(family, heads_kv, layers, seq, seed):
    heads, kv = heads_kv
    gen = torch.Generator().manual_seed(seed)
    selected = [sorted(set(torch.randint(0, heads, (2,), generator=gen).tolist())) for _ in range(layers)]
    source, dex = retrofit_pair(family, "dex", seed, selected, heads=heads, kv_heads=kv, layers=layers, hidden=8 * heads)
    # f_D random: the model must still be exact because λ = 0 at step 0
    for module in dex.modules():
        if hasattr(module, "f_d"):
            torch.nn.init.normal_(module.f_d.weight, generator=gen)
    ids = torch.randint(0, 300, (2, seq), generator=gen)
    with torch.no_grad():
        assert torch.equal(source(input_ids=ids).logits, dex(input_ids=ids).logits)
        set_step(dex, 50, 100)  # ramp = 1: now the op acts
        assert not torch.allclose(source(input_ids=ids).logits, dex(input_ids=ids).logits)


def test_dex_generate_matches_source_with_cache():
    source, dex = retrofit_pair("llama", "dex", 3)
    ids = torch.randint(0, 300, (1, 5))
    a = source.generate(ids, max_new_tokens=6, do_sample=False)
    b = dex.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)


def test_dex_acts_only_on_selected_heads():
    source, dex = retrofit_pair("llama", "dex", 1, selected=[[1], [0, 3]])
    attn = dex.model.layers[0].self_attn
    torch.nn.init.normal_(attn.dex.f_d.weight)
    set_step(dex, 1, 1)
    out = torch.randn(2, 3, 4, 8)  # [B, T, H, d]
    changed = (attn.dex(out) != out).flatten(0, 1).any(0).any(-1)  # per head
    assert changed.tolist() == [False, True, False, False]
    lam = float(attn.dex.lambda_init)
    expected = out[:, :, 1] - lam * attn.dex.f_d(out[:, :, 1])
    assert torch.allclose(attn.dex(out)[:, :, 1], expected)


# ------------------------------------------------------------------ CLI


def test_convert_dex_cli_report(tmp_path, calib):
    src = save_tiny_model(tmp_path / "src", "qwen2")
    out = tmp_path / "out"
    assert convert_cli("dex", src, out, calib, "--heads", "0.5") == 0
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["method"] == "dex" and report["source"]["model_type"] == "qwen2"
    assert report["steps"][0]["exact"] is True and report["steps"][0]["logits_rel_err_max"] == 0.0
    assert report["ppl"]["before"] == report["ppl"]["after"]
    kv = report["kv_cache_bytes_per_token"]
    assert kv["before"] == kv["after"] > 0
    heads = report["heads"]
    assert [len(s) for s in heads["selected"]] == [2, 2]
    for scores, chosen in zip(heads["scores"], heads["selected"]):
        assert min(scores[h] for h in chosen) >= max(scores[h] for h in range(4) if h not in chosen)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "attnkit_qwen2" and config["attnkit"]["selected_heads"] == heads["selected"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_attnkit.AttnkitQwen2ForCausalLM"
    for name in ("modeling_attnkit.py", "dex.py", "diff.py", "README.md", "tokenizer.json"):
        assert (out / name).is_file(), name


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--heads", "loudest"], "unknown head-selection rule"),
        (["--heads", "1.5"], "(0, 1]"),
        (["--heads", "0"], "(0, 1]"),
        (["--heads", "auto", "--heads-fraction", "-1"], "(0, 1]"),
    ],
)
def test_convert_dex_bad_heads(tmp_path, calib, capsys, extra, message):
    src = tmp_path / "src"
    src.mkdir()
    out = tmp_path / "out"
    assert convert_cli("dex", src, out, calib, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_convert_dex_refuses_unknown_attention(tmp_path, calib, capsys):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    src = tmp_path / "qwen3"
    config = Qwen3Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=50)
    Qwen3ForCausalLM(config).save_pretrained(src)
    out = tmp_path / "out"
    capsys.readouterr()
    assert convert_cli("dex", src, out, calib) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'qwen3' is not recognised" in err[0]
    assert not out.exists()


def test_convert_refuses_an_attnkit_model(tmp_path, calib, capsys):
    src = save_tiny_model(tmp_path / "src", "llama")
    assert convert_cli("dex", src, tmp_path / "dex", calib) == 0
    assert convert_cli("diff", tmp_path / "dex", tmp_path / "again", calib) == 2
    assert "already an attnkit dex model" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()
