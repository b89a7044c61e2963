"""`attnkit bench` end to end on tiny checkpoints: measured cache bytes, refusal, OOM rows, outputs."""

import json

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from attnkit.cli import main
from attnkit.evaluation import bench
from attnkit.evaluation.bench_report import format_table
from attnkit.evaluation.membw import copy_bandwidth

RANK, ROPE, LAYERS = 12, 8, 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_models")
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=RANK, qk_rope_head_dim=ROPE, qk_nope_head_dim=8,
        v_head_dim=8, first_k_dense_replace=LAYERS, n_routed_experts=2, max_position_embeddings=64,
    )).save_pretrained(root / "mla")
    LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )).save_pretrained(root / "gqa")
    return root


def _run(models, tmp_path, *extra, batch="1"):
    out = tmp_path / "bench.json"
    argv = ["bench", str(models / "mla"), "--context", "8,16", "--batch", batch, "--decode-tokens", "3",
            "--repeats", "2", "--device", "cpu", "--threads", "1", "--out", str(out), *extra]
    return main(argv), out


@pytest.mark.slow
def test_bench_end_to_end(models, tmp_path, capsys):
    rc, out = _run(models, tmp_path, "--baseline", str(models / "gqa"), "--prefill-chunk", "4", batch="1,2")
    assert rc == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 1000
    mla, gqa = result["models"]["model"], result["models"]["baseline"]
    assert mla["mla"] and "absorbed" in mla["attn_path"] and "plain" in gqa["attn_path"]
    assert "not an MLA model" in capsys.readouterr().err
    for row in mla["results"]:
        assert row["status"] == "ok"
        # measured from the cache object: exactly (r + d_r) · layers · 4 bytes per token at every length
        assert row["kv_cache_bytes"] == (RANK + ROPE) * LAYERS * 4 * row["batch"] * row["context"]
        assert row["decode_tokens_per_s"]["min"] <= row["decode_tokens_per_s"]["median"] <= row["decode_tokens_per_s"]["max"]
        assert len(row["prefill_tokens_per_s"]["values"]) == 2
        assert row["attention_vs_bound"] > 0
    for row in gqa["results"]:
        assert row["kv_cache_bytes"] == 2 * 2 * 8 * LAYERS * 4 * row["batch"] * row["context"]
    assert len(result["comparison"]) == 4
    assert result["comparison"][0]["kv_cache_ratio"] == pytest.approx((RANK + ROPE) / 32)
    assert result["machine"]["memory_bandwidth"]["bytes_per_s"] > 0


def test_context_beyond_max_positions_is_refused(models, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", str(models / "mla"), "--context", "40,128", "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "max_position_embeddings 64" in err and err.count("\n") == 1
    assert not out.exists()


def test_oom_at_one_length_is_recorded_and_the_run_goes_on(models, tmp_path, monkeypatch):
    real = bench.measure_once

    def flaky(model, ids, *args, **kwargs):
        if ids.shape[1] + 3 == 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, ids, *args, **kwargs)

    monkeypatch.setattr(bench, "measure_once", flaky)
    rc, out = _run(models, tmp_path, "--attn", "expanded")
    assert rc == 0
    result = json.loads(out.read_text())
    rows = result["models"]["model"]["results"]
    assert [r["status"] for r in rows] == ["ok", "oom"]
    assert "out of memory" in rows[1]["error"]
    assert "expanded MLA (transformers" in result["models"]["model"]["attn_path"]
    assert "OOM" in format_table(result)


def test_other_errors_are_not_swallowed(models, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(bench, "measure_once", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        _run(models, tmp_path)


def test_bad_settings(models, tmp_path, capsys):
    assert main(["bench", str(models / "mla"), "--context", "4", "--decode-tokens", "8"]) == 2
    assert main(["bench", str(models / "mla"), "--context", "8", "--decode-tokens", "2", "--out", str(tmp_path / "x.txt")]) == 2
    assert "--out must name a .json file" in capsys.readouterr().err


def test_stats_and_bandwidth():
    s = bench.stats([3.0, 1.0, 2.0, 10.0])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 10.0
    assert s["spread"] == pytest.approx(9.0 / 2.5)
    bw = copy_bandwidth("cpu", megabytes=16, repeats=2)
    assert bw["bytes_per_s"] > 1e8


def test_predicted_oom_on_cpu_is_recorded_without_running(models, tmp_path, monkeypatch):
    class Tiny:
        available = 1024

    monkeypatch.setattr(bench.psutil, "virtual_memory", lambda: Tiny())
    real, lengths = bench.measure_once, []

    def spy(model, ids, *args, **kwargs):
        lengths.append(ids.shape[1])
        return real(model, ids, *args, **kwargs)

    monkeypatch.setattr(bench, "measure_once", spy)
    rc, out = _run(models, tmp_path)
    assert rc == 0
    assert lengths == [16]  # the warm-up only
    rows = json.loads(out.read_text())["models"]["model"]["results"]
    assert [r["status"] for r in rows] == ["oom", "oom"] and "predicted" in rows[0]["error"]


def test_one_progress_bar_over_both_models_names_each(models, capsys):
    """Issue "The first hour": the bar counts every case of every model (one ETA for the whole run) and says
    which model it is measuring."""
    assert main(["bench", str(models / "mla"), "--baseline", str(models / "gqa"), "--context", "8", "--batch", "1,2",
                 "--decode-tokens", "2", "--repeats", "1", "--device", "cpu", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert f"{models / 'mla'} ctx=8 batch=2" in err and f"{models / 'gqa'} ctx=8 batch=1" in err
    # one total for the whole run: the bar is full only once the second model has run
    assert "bench: 100%" in err and err.index("bench: 100%") > err.index(f"{models / 'gqa'} ctx=8 batch=1")


def test_progress_weights_cases_by_their_work():
    """A case counts by its arithmetic: a 16K context is far more than 16x a 1K one (attention), twice
    the batch twice the work; the weights' own cost dominates short contexts of a large model."""
    from attnkit.evaluation.bench import case_weight

    small = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "head_dim": 64, "intermediate_size": 768}
    big = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "head_dim": 64, "intermediate_size": 8192}
    assert case_weight(small, 16384, 1, 32) > 16 * 4 * case_weight(small, 1024, 1, 32)
    assert case_weight(small, 1024, 2, 32) == pytest.approx(2 * case_weight(small, 1024, 1, 32))
    assert case_weight(big, 4096, 1, 0) < 1.2 * 4 * case_weight(big, 1024, 1, 0)  # nearly linear there


def test_out_never_overwrites_a_picture_it_did_not_write(models, tmp_path, capsys):
    """The PNG beside --out is replaced only when the JSON there is an earlier bench result of ours."""
    out = tmp_path / "r.json"
    (tmp_path / "r.png").write_bytes(b"someone else's plot")
    assert main(["bench", str(models / "mla"), "--context", "8", "--decode-tokens", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "r.png exists" in err[0]
    assert (tmp_path / "r.png").read_bytes() == b"someone else's plot" and not out.exists()
