"""Issue "The first hour": convert, eval and bench give a converted model's KV-cache bytes per token as
one figure in one dtype (the dtype the checkpoint is stored in), and every printed figure names it.

Before: convert printed "2048 -> 608" (bf16 bytes) and eval "4,096 / 1,216" (fp32, the dtype it ran in),
neither saying which."""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from attnkit.cli import main
from attnkit.evaluation.kv import (checkpoint_dtype, format_kv, kv_as_stored, kv_cache_bytes_per_token, kv_change,
                                   short_dtype)
from attnkit.io.resolve import REFERENCE_DIR

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import calib_folder  # noqa: E402

FAST = ["--calib-tokens", "256", "--calib-seq-len", "32", "--eval-tokens", "128"]


def test_short_names_and_rescaling():
    assert [short_dtype(d) for d in (torch.bfloat16, "float32", "F16", "BF16", "int8")] == ["bf16", "fp32", "fp16", "bf16", "int8"]
    assert kv_as_stored(4096, torch.float32, "bf16") == {"bytes_per_token": 2048, "dtype": "bf16"}
    assert kv_as_stored(2048, "bfloat16", torch.float32) == {"bytes_per_token": 4096, "dtype": "fp32"}
    assert kv_as_stored(1000, "bfloat16,float32", "bf16") == {"bytes_per_token": 1000, "dtype": "bfloat16,float32"}
    assert format_kv(4096, torch.float32) == "4,096 B/token (fp32)"
    assert format_kv(608, "bfloat16", "as stored") == "608 B/token (bf16, as stored)"
    assert kv_change({"before": 2048, "after": 608, "dtype": "bf16"}) == "KV cache: 2,048 -> 608 B/token (bf16), 29.7 % of the source"


def test_a_sliding_window_cache_is_named_by_its_values_dtype():
    """transformers' sliding-window cache layers also hold an int64 tensor: the cache's dtype is its values'."""
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, sliding_window=4096)
    kv = kv_cache_bytes_per_token(MistralForCausalLM(cfg).to(torch.bfloat16))
    assert kv["dtype"] == "bfloat16" and kv["total"] == 2 * 8 * 2


def test_checkpoint_dtype_reads_the_header(tmp_path):
    assert checkpoint_dtype(REFERENCE_DIR) == "bf16"
    assert checkpoint_dtype(tmp_path) is None


@pytest.fixture(scope="module")
def bf16_source(tmp_path_factory):
    """A tiny Llama stored in bf16 (like the reference), with the reference tokenizer (eval's tasks need it)."""
    folder = tmp_path_factory.mktemp("kvdtype") / "src"
    tok = AutoTokenizer.from_pretrained(REFERENCE_DIR)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=2048,
                         eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("to, extra, after", [("mla", ["--kv-lora-rank", "8", "--rope-dim", "8"], 2 * (8 + 8) * 2),
                                             ("dex", [], 2 * 2 * 2 * 8 * 2)])
def test_convert_eval_and_bench_agree(bf16_source, tmp_path, capsys, to, extra, after):
    out = tmp_path / "out"
    assert main(["convert", "--to", to, str(bf16_source), "-o", str(out), "--calib",
                 str(calib_folder(tmp_path / "calib")), *FAST, *extra]) == 0
    convert_out = capsys.readouterr().out
    report = json.loads((out / "attnkit_report.json").read_text())["kv_cache_bytes_per_token"]
    before = 2 * 2 * 2 * 8 * 2  # K and V, 2 layers, 2 KV heads, head_dim 8, bf16
    assert report == {"before": before, "after": after, "dtype": "bf16"}
    assert format_kv(after, "bf16") in convert_out

    # eval and bench run in fp32 (their default): the stored figure is the same, this run's is beside it
    assert main(["eval", str(out), "--tasks", "attnkit-ppl-quick", "--limit", "1", "--out", str(tmp_path / "e.json")]) == 0
    eval_table = capsys.readouterr().out
    model = json.loads((tmp_path / "e.json").read_text())["models"]["model"]
    assert (model["kv_cache_bytes_per_token"], model["kv_cache_dtype"]) == (after, "bf16")
    assert model["kv_cache_measured"] == {"bytes_per_token": 2 * after, "dtype": "fp32", "per_layer": [after, after]}
    kv_rows = [line for line in eval_table.splitlines() if "KV bytes/token" in line]
    assert "(bf16, as stored)" in kv_rows[0] and kv_rows[0].split()[-1] == f"{after:,}"
    assert "(fp32, in this run)" in kv_rows[1] and kv_rows[1].split()[-1] == f"{2 * after:,}"

    assert main(["bench", str(out), "--context", "16", "--decode-tokens", "2", "--repeats", "1", "--threads", "1",
                 "--out", str(tmp_path / "b.json")]) == 0
    bench_table = capsys.readouterr().out
    info = json.loads((tmp_path / "b.json").read_text())["models"]["model"]
    assert (info["kv_cache_bytes_per_token"], info["kv_cache_dtype"]) == (after, "bf16")
    assert (info["kv_cache_measured"]["bytes_per_token"], info["kv_cache_measured"]["dtype"]) == (2 * after, "fp32")
    assert f"KV cache {format_kv(after, 'bf16', 'as stored')}; {format_kv(2 * after, 'fp32', 'in this run')}" in bench_table
