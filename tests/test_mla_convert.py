"""`attnkit convert --to mla` end to end: every family converts, loads natively and matches."""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnkit.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import logits_rel, save_model  # noqa: E402
from conftest import refused_in_one_line, tree_digest  # noqa: E402

FAST = ["--calib-tokens", "256", "--calib-seq-len", "32", "--eval-tokens", "128"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("llama") / "src", "llama")


def _convert(src, out, calib, *extra):
    return main(["convert", "--to", "mla", str(src), "-o", str(out), "--calib", str(calib), *FAST, *extra])


@pytest.mark.parametrize("kind", ["llama", "llama3", "mistral", "qwen2", "phi3", "smollm", "mha", "mqa"])
def test_full_size_is_exact_and_loads_natively(tmp_path, calib, kind):
    src = save_model(tmp_path / "src", kind)
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(src)
    G, d = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or 16
    assert _convert(src, tmp_path / "out", calib, "--rope-dim", str(G * d), "--kv-lora-rank", str(G * d + 1),
                    "--target", "transformers") == 0
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg["model_type"] == "deepseek_v3" and out_cfg["first_k_dense_replace"] == cfg.num_hidden_layers
    assert out_cfg["num_key_value_heads"] == cfg.num_attention_heads and "auto_map" not in out_cfg
    assert out_cfg["tie_word_embeddings"] == bool(cfg.tie_word_embeddings)
    assert logits_rel(src, tmp_path / "out") < 1e-4
    report = json.loads((tmp_path / "out" / "attnkit_report.json").read_text())
    assert report["method"] == "mla" and report["load"]["trust_remote_code"] is False
    assert [s["name"] for s in report["steps"]] == ["exact", "rope", "balance", "low-rank", "refit", "native"]
    assert all(s["logits_rel_err_max"] < 1e-4 for s in report["steps"])
    assert abs(report["ppl"]["after"] / report["ppl"]["before"] - 1) < 1e-4


def test_compressed_report_and_measured_cache(tmp_path, calib, llama):
    from attnkit.evaluation.kv import kv_cache_bytes_per_token

    src = llama
    assert _convert(src, tmp_path / "out", calib, "--rope-dim", "8", "--kv-lora-rank", "17", "--rope-method", "partial") == 0
    report = json.loads((tmp_path / "out" / "attnkit_report.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert not steps["rope"]["exact"] and not steps["low-rank"]["exact"] and steps["balance"]["exact"]
    assert steps["low-rank"]["logits_rel_err_mean"] > 1e-4
    assert report["lossy_steps"] == ["rope", "low-rank"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert kv_cache_bytes_per_token(model)["total"] == report["kv_cache_bytes_per_token"]["after"] == 2 * (17 + 8) * 4
    assert (tmp_path / "out" / "README.md").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()


def test_geometric_frequencies_and_bf16_sharded_source(tmp_path, calib):
    from attnkit.io.checkpoint import LazyCheckpoint, ShardedWriter

    src = save_model(tmp_path / "one", "mqa", dtype=torch.bfloat16)
    sharded = tmp_path / "src"
    writer = ShardedWriter(sharded, max_shard_bytes=20_000)
    ck = LazyCheckpoint(src)
    for name in ck.keys():
        writer.add(name, ck.get(name))
    writer.close()
    for f in src.iterdir():
        if not f.name.startswith("model"):
            (sharded / f.name).write_bytes(f.read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert _convert(sharded, tmp_path / "out", calib, "--rope-frequencies", "geometric", "--rope-dim", "16",
                    "--kv-lora-rank", "17", "--dtype", "fp32", "--target", "transformers") == 0
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg["rope_parameters"]["rope_type"] == "yarn" and out_cfg["rope_parameters"]["factor"] == 1.0
    # the transformers-only form: a name engines refuse; transformers builds it from model_type (logits below)
    assert out_cfg["architectures"] == ["AttnkitExactDeepseekV3ForCausalLM"]
    assert logits_rel(sharded, tmp_path / "out") < 1e-4  # MQA, d_r = d: the plain ladder is exact


def test_a_bf16_source_calibrated_natively_reports_it_and_loses_nothing_measurable(tmp_path, calib, monkeypatch):
    """`--calib-dtype auto` on a CPU that multiplies bf16 natively: the MLP carries the rows in bf16, the
    report says so, and the conversion's figures stay within bf16's rounding of the fp32 run's."""
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: True, raising=False)
    src = save_model(tmp_path / "src", "llama", dtype=torch.bfloat16)
    reports = {}
    for calib_dtype in ("fp32", "auto"):
        out = tmp_path / calib_dtype
        assert _convert(src, out, calib, "--kv-lora-rank", "12", "--rope-dim", "4", "--calib-dtype", calib_dtype) == 0
        reports[calib_dtype] = json.loads((out / "attnkit_report.json").read_text())
    assert reports["fp32"]["calibration"]["mlp_dtype"] == "float32"
    assert reports["auto"]["calibration"]["mlp_dtype"] == "bfloat16"
    kl = {k: r["steps"][-1]["kl"] for k, r in reports.items()}
    assert kl["fp32"] > 1e-3 and abs(kl["auto"] - kl["fp32"]) < 0.02 * kl["fp32"], kl  # 0.15 % apart when written


@pytest.mark.parametrize("extra, message", [
    (["--kv-lora-rank", "0"], "--kv-lora-rank must be"),
    (["--kv-lora-rank", "1000"], "--kv-lora-rank must be"),
    (["--rope-dim", "7"], "--rope-dim must be even"),
    (["--rope-dim", "64"], "--rope-dim must be even"),
    (["--rope-dim", "32", "--rope-frequencies", "geometric"], "--rope-dim must be even"),
])
def test_bad_settings(tmp_path, calib, llama, capsys, extra, message):
    refused_in_one_line(lambda: _convert(llama, tmp_path / "out", calib, *extra), capsys, tmp_path / "out", message)


def test_refusals_empty_calib_nonempty_out_disk_and_interrupt(tmp_path, calib, llama, capsys, monkeypatch):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    Gemma2ForCausalLM(Gemma2Config(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, vocab_size=100)).save_pretrained(tmp_path / "g2")
    assert _convert(tmp_path / "g2", tmp_path / "o", calib) == 2
    assert "softcapping" in capsys.readouterr().err
    src = llama
    before = tree_digest(src)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("   ")
    assert _convert(src, tmp_path / "o", empty) == 2
    assert "calibration source" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep")
    assert _convert(src, busy, calib) == 2 and "not empty" in capsys.readouterr().err
    assert (busy / "x").read_text() == "keep"
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 10, 0))
    assert _convert(src, tmp_path / "o", calib) == 2 and "not enough disk" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.attnkit-*"))  # refused inside the claim: nothing left
    monkeypatch.undo()
    import attnkit.converters.mla.convert as pipe

    def interrupt(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(pipe, "layer_tensors", interrupt)
    assert _convert(src, tmp_path / "o", calib) == 130
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.attnkit-tmp-*"))
    assert tree_digest(src) == before


def test_eval_flag_evaluates_the_output_against_its_source(tmp_path, calib, llama, capsys):
    """`convert --eval`: the output is evaluated against MODEL in the same process, as `attnkit eval OUT
    --baseline MODEL --out OUT/eval_results.json` would, and the model card states it."""
    out = tmp_path / "out"
    assert _convert(llama, out, calib, "--rope-dim", "8", "--kv-lora-rank", "17", "--eval", "--tasks",
                    "attnkit-recall-256") == 0
    printed = capsys.readouterr().out
    assert printed.index(f"wrote {out}\n") < printed.index("attnkit-recall-256")  # the model is written first
    result = json.loads((out / "eval_results.json").read_text())
    assert result["tasks"] == ["attnkit-recall-256"] and result["limit"] is None
    for role, folder in (("model", out), ("baseline", Path(llama))):  # relative to OUT, or by name: no absolute path
        path = result["models"][role]["path"]
        assert not Path(path).is_absolute() and ((out / path).resolve() == folder.resolve() or path == folder.name)
    report = json.loads((out / "attnkit_report.json").read_text())
    assert result["models"]["model"]["kv_cache_bytes_per_token"] == report["kv_cache_bytes_per_token"]["after"]
    assert "attnkit-recall-256" in (out / "README.md").read_text()  # the card was rewritten with the results


def test_eval_flag_checks_its_tasks_before_converting(tmp_path, calib, llama, capsys):
    refused_in_one_line(lambda: _convert(llama, tmp_path / "out", calib, "--eval", "--tasks", "attnkit-nope"),
                        capsys, tmp_path / "out", "attnkit-nope")


def test_one_progress_bar_over_the_pre_pass_and_the_conversion(tmp_path, calib, llama, capfd):
    """One bar names the model and walks both passes, so its ETA covers the whole conversion; the
    bar ends full (each pass's layers weighted by the rows it reads)."""
    from attnkit.converters.mla.progress import CONVERT_READS, PRE_PASS_READS, ConversionProgress, pre_pass_rows

    bar = ConversionProgress("m", 3, 40, pre_pass=True)
    assert bar.bar.total == 3 * (PRE_PASS_READS * pre_pass_rows(40) + CONVERT_READS * 40)
    for what in ("rope scores", "convert"):
        assert list(bar.walk(what)) == [0, 1, 2]
    assert bar.bar.n == bar.bar.total
    assert _convert(llama, tmp_path / "out", calib, "--rope-dim", "8", "--kv-lora-rank", "17") == 0
    err = capfd.readouterr().err
    assert f"{Path(llama).name}: convert --to mla" in err and "rope scores, layer 1/" in err and "convert, layer 1/" in err
    assert "(pre-pass)" not in err  # no second bar of its own
    assert "100%" in err
