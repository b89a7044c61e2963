"""`attnkit convert --to titans` on tiny random checkpoints of every family: the written model is the
source at conversion (gate closed, W >= the sequence), loads in a fresh process with
trust_remote_code (and fails loudly without it), reports a state that stops growing at W; bad input
is one line, exit 2, nothing written, the source untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import tree_digest
from mla_fixtures import save_model
from test_dex_models import FAMILIES, calib, convert_cli, fresh_process_logits, save_tiny_model  # noqa: F401 (fixture)
from transformers import AutoModelForCausalLM

import attnkit.adapters  # noqa: F401  (registers attnkit_<family>)


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("titans") / "src", "llama")


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_is_the_source_with_the_gate_closed(tmp_path, calib, family):
    src = save_tiny_model(tmp_path / "src", family)
    out = tmp_path / "out"
    assert convert_cli("titans", src, out, calib, "--window", "64", "--chunk", "8", "--memory-depth", "2") == 0
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["method"] == "titans" and report["steps"][-1]["exact"] is True
    titans = report["titans"]
    assert (titans["window"], titans["chunk"], titans["memory_depth"], titans["variant"]) == (64, 8, 2, "mag")
    assert titans["memory_qkv_init"].startswith("the layer's") == (family != "deepseek_v3")
    assert len(set(titans["state_bytes"]["bytes"])) == 1  # 1, 2 and 4 windows: the same state
    kv = report["kv_cache_bytes_per_token"]
    assert kv["after"] == kv["before"]  # below W a token adds the source's keys/values, nothing else
    ids = torch.randint(0, 300, (2, 40))
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(converted).__name__.startswith("Attnkit")
    with torch.no_grad():
        torch.testing.assert_close(converted(input_ids=ids).logits, source(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


def test_memory_starts_from_the_layers_projections(tmp_path, capsys, calib, llama_src):
    out = tmp_path / "out"
    assert convert_cli("titans", llama_src, out, calib, "--window", "32", "--chunk", "4") == 0
    state = json.loads((out / "attnkit_report.json").read_text())["titans"]["state_bytes"]
    printed = capsys.readouterr().out
    assert f"Titans: window 32, chunk 4, memory depth 2 x dim 8; whole cache after a forward pass (fp32): " \
           f"{state['bytes'][0]:,} B at 32" in printed
    # the per-token KV line and the model card say the state is bounded, with the bytes
    assert f"bounded: the last 31 tokens' keys/values per layer + the memory" in printed
    assert f"The state is bounded: the last 31 tokens' keys/values" in (out / "README.md").read_text()
    assert f"{state['bytes'][-1]:,} B at 128" in (out / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    attn = model.model.layers[1].self_attn
    heads, d = model.config.num_attention_heads, model.config.head_dim
    assert torch.equal(attn.titans.q_proj.weight, attn.q_proj.weight)
    kv = attn.k_proj.weight.view(-1, d, model.config.hidden_size)  # [G, d, D]
    assert torch.equal(attn.titans.k_proj.weight.view(heads, d, -1), kv.repeat_interleave(heads // kv.shape[0], dim=0))


def test_fresh_process_loads_with_remote_code_only(tmp_path, calib, llama_src):
    """With sparse slots too: a 30-token forward at W = 16 reads them, in a venv-like process without attnkit."""
    out = tmp_path / "out"
    assert convert_cli("titans", llama_src, out, calib, "--window", "16", "--chunk", "4", "--sparse-slots", "3",
                       "--slot-bias", "-0.5", "--memory-gate", "shut") == 0
    config = json.loads((out / "config.json").read_text())
    assert (out / "titans.py").is_file() and "auto_map" in config
    assert {k: config["attnkit"][k] for k in ("sparse_slots", "slot_bias", "memory_mix")} == \
        {"sparse_slots": 3, "slot_bias": -0.5, "memory_mix": False}
    ids = torch.randint(0, 300, (1, 30))
    (fresh,) = fresh_process_logits([out], ids, tmp_path)
    with torch.no_grad():
        here = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(input_ids=ids).logits
    assert torch.equal(fresh, here)
    code = "import sys\nfrom transformers import AutoModelForCausalLM\nAutoModelForCausalLM.from_pretrained(sys.argv[1])"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "mods")}
    run = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode != 0 and "trust_remote_code" in run.stderr


@pytest.mark.parametrize("flags, words", [
    (["--window", "0"], "--window"),
    (["--window", "100000"], "context"),
    (["--chunk", "0"], "--chunk"),
    (["--window", "8", "--chunk", "16"], "--chunk"),
    (["--memory-depth", "-1"], "--memory-depth"),
    (["--memory-depth", "5"], "--memory-depth"),
    (["--memory-dim", "33"], "--memory-dim"),
    (["--variant", "mal"], "not implemented"),
    (["--sparse-slots", "-1"], "--sparse-slots"),
    (["--memory-depth", "0", "--sparse-slots", "4"], "needs a memory"),
    (["--sparse-slots", "4", "--slot-bias", "nan"], "--slot-bias"),
    (["--memory-gate", "shut"], "--memory-gate shut needs --sparse-slots"),
])
def test_bad_settings_are_one_line_and_nothing_is_written(tmp_path, capsys, calib, llama_src, flags, words):
    before = tree_digest(llama_src)
    capsys.readouterr()
    assert convert_cli("titans", llama_src, tmp_path / "out", calib, *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [] and tree_digest(llama_src) == before


def test_unsupported_family_and_a_converted_model_are_refused(tmp_path, capsys, calib, llama_src):
    phi = save_model(tmp_path / "phi", "phi3")  # fused qkv_proj: no runtime retrofit
    converted = tmp_path / "titans"
    assert convert_cli("titans", llama_src, converted, calib, "--window", "16", "--chunk", "4") == 0
    for source, words in ((phi, "not recognised"), (converted, "already an attnkit titans model")):
        before = tree_digest(source)
        capsys.readouterr()
        assert convert_cli("titans", source, tmp_path / "out", calib) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
        assert not (tmp_path / "out").exists() and tree_digest(source) == before


def test_bench_reports_a_state_that_stops_growing_at_the_window(tmp_path, calib, llama_src):
    from attnkit.cli import main

    out = tmp_path / "out"
    assert convert_cli("titans", llama_src, out, calib, "--window", "8", "--chunk", "4") == 0
    assert main(["bench", str(out), "--baseline", str(llama_src), "--context", "4,8,16,32,64", "--decode-tokens", "2",
                 "--repeats", "1", "--device", "cpu", "--out", str(tmp_path / "bench.json")]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    titans = {r["context"]: r["kv_cache_bytes"] for r in result["models"]["model"]["results"]}
    source = {r["context"]: r["kv_cache_bytes"] for r in result["models"]["baseline"]["results"]}
    assert titans[4] < titans[8] == titans[16] == titans[32] == titans[64]
    assert source[64] == 8 * source[8]  # the source's grows with every token


@pytest.mark.slow
def test_mla_plus_titans_composes(tmp_path, calib, llama_src):
    """`--to mla+titans`: MLA, then Titans on its DeepSeek-V3 output; gate closed and W >= the rows,
    the written model equals the MLA step's (report: exact), the report speaks of the user's model,
    and it generates with the bounded cache."""
    from attnkit.adapters.titans import TitansCache

    out = tmp_path / "mla-titans"
    assert convert_cli("mla+titans", llama_src, out, calib, "--window", "32", "--chunk", "4") == 0
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["method"] == "mla+titans" and report["source"]["model_type"] == "llama"
    assert report["steps"][-1]["exact"] is True and len(report["steps"]) > 1
    assert report["titans"]["memory_qkv_init"] == "seeded random"  # latent attention: no q/k/v to copy
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.config.attnkit["base_model_type"] == "deepseek_v3" and model.config.attnkit["method"] == "mla+titans"
    gen = model.generate(input_ids=torch.randint(2, 300, (2, 40)), max_new_tokens=3, do_sample=False,
                         return_dict_in_generate=True, pad_token_id=0)
    assert isinstance(gen.past_key_values, TitansCache)
    assert not list(tmp_path.glob("*scratch*")) and not list(tmp_path.glob(".*"))
