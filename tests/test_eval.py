"""`attnkit eval`: JSON schema, retention, KV bytes from the cache, and its error paths."""

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from attnkit.cli import main
from attnkit.evaluation import tasks as bundled
from attnkit.io.resolve import REFERENCE_DIR


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Llama with the reference tokenizer, saved like any HF checkpoint."""
    folder = tmp_path_factory.mktemp("tiny")
    tok = AutoTokenizer.from_pretrained(REFERENCE_DIR)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, max_position_embeddings=2048, eos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_task_groups_expand():
    assert bundled.expand("attnkit-core") == bundled.BUNDLED
    assert bundled.expand("attnkit-recall,attnkit-ppl") == [*bundled.RECALL, "attnkit-ppl"]


@pytest.mark.slow
def test_eval_with_baseline_writes_the_documented_schema(tiny_model, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["eval", str(tiny_model), "--baseline", str(tiny_model), "--tasks", "attnkit-ppl,attnkit-recall-256",
                 "--limit", "2", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["schema"] == "attnkit.eval/v1"
    assert result["tasks"] == ["attnkit-ppl", "attnkit-recall-256"]
    model = result["models"]["model"]
    assert set(model) >= {"name", "path", "params", "dtype", "kv_cache_bytes_per_token", "metrics"}
    # 2 (K, V) x 2 layers x 2 KV heads x head_dim 8 x 4 bytes, measured from the cache object
    assert model["kv_cache_bytes_per_token"] == 2 * 2 * 2 * 8 * 4
    ppl = model["metrics"]["attnkit-ppl"]
    assert ppl["token_perplexity"] > 1 and ppl["byte_perplexity"] > 1
    assert 0 <= model["metrics"]["attnkit-recall-256"]["acc"] <= 1
    # the same model as its own baseline keeps everything
    ratios = [v for v in result["retention"].values() if v is not None]
    assert ratios and all(v == pytest.approx(1.0) for v in ratios)
    table = capsys.readouterr().out
    assert "retention" in table and "token_perplexity" in table and "KV bytes/token" in table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "/no/such/model"], "does not exist"),
        (["eval", "{tiny}", "--tasks", "attnkit-nope"], "unknown task 'attnkit-nope'"),
        (["eval", "{tiny}", "--out", "{tmp}"], "is a folder"),
    ],
)
def test_eval_bad_input_is_one_line(argv, message, tiny_model, tmp_path, capsys):
    argv = [a.replace("{tiny}", str(tiny_model)).replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_corrupt_weights_and_non_causal_folders(tiny_model, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    assert main(["eval", str(broken)]) == 2
    assert "cannot load" in capsys.readouterr().err
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["LlamaModel"]
    (broken / "config.json").write_text(json.dumps(config))
    assert main(["eval", str(broken)]) == 2
    assert "not a causal language model" in capsys.readouterr().err
