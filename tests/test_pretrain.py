"""`attnkit pretrain` on a tiny corpus: it trains, exports a loadable model, and resumes exactly."""

import json

import pytest
import torch

from attnkit.errors import AttnkitError
from attnkit.training import pretrain
from attnkit.training.config import load_recipe
from attnkit.training.pretrain import PretrainRecipe


def _recipe(tmp_path, corpus, **train):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "r.yaml").write_text(
        f"""
run_dir: {tmp_path / 'run'}
export_dir: {tmp_path / 'export'}
corpus: {corpus}
tokenizer: {{vocab_size: 300, min_frequency: 1}}
model: {{hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8,
         intermediate_size: 64, max_position_embeddings: 128}}
train: {{seq_len: 16, batch_size: 4, tokens: 384, warmup_steps: 1, eval_every: 3, eval_rows: 2, save_every: 2,
         long_seq_len: 32, long_fraction: 0.34, autocast_bf16: false}}
export_dtype: fp32
"""
    )
    return load_recipe(tmp_path / "r.yaml", PretrainRecipe, [f"train.{k}={v}" for k, v in train.items()])


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(60):
        (folder / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 12)
    return str(folder)


def test_trains_exports_and_resumes_exactly(tmp_path, corpus, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    full = pretrain.train(_recipe(tmp_path / "a", corpus))
    assert full["steps"] == 6 and full["tokens_seen"] == 384
    export = tmp_path / "a" / "export"
    model = AutoModelForCausalLM.from_pretrained(export)
    tok = AutoTokenizer.from_pretrained(export)
    assert model.config.num_key_value_heads == 2 and len(tok) <= 300
    assert "validation ppl" in (export / "README.md").read_text()
    log = [json.loads(line) for line in (tmp_path / "a" / "run" / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == list(range(1, 7)) and "val_loss" in log[2]

    # Interrupt the second run after step 3 (last checkpoint: step 2), then resume it.
    calls = {"n": 0}
    real_step = torch.optim.AdamW.step

    def flaky_step(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", flaky_step)
    with pytest.raises(KeyboardInterrupt):
        pretrain.train(_recipe(tmp_path / "b", corpus))
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    assert not (tmp_path / "b" / "export").exists()
    pretrain.train(_recipe(tmp_path / "b", corpus))
    a = AutoModelForCausalLM.from_pretrained(export).state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "export").state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_run_dir_of_another_recipe_is_refused(tmp_path, corpus):
    pretrain.train(_recipe(tmp_path, corpus))
    with pytest.raises(AttnkitError, match="different recipe"):
        pretrain.train(_recipe(tmp_path, corpus, lr=0.5))


def test_foreign_export_dir_is_refused_before_training(tmp_path, corpus):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "mine.txt").write_text("keep me")
    with pytest.raises(AttnkitError, match="not an earlier pretrain export"):
        pretrain.train(_recipe(tmp_path, corpus))
    assert (tmp_path / "export" / "mine.txt").read_text() == "keep me"
    assert not (tmp_path / "run").exists()


def test_recipe_errors_name_the_key(tmp_path, corpus):
    _recipe(tmp_path, corpus)
    with pytest.raises(AttnkitError, match="train.lrr"):
        load_recipe(tmp_path / "r.yaml", PretrainRecipe, ["train.lrr=1"])
    with pytest.raises(AttnkitError, match="train.batch_size"):
        load_recipe(tmp_path / "r.yaml", PretrainRecipe, ["train.batch_size=big"])
    with pytest.raises(AttnkitError, match="is not KEY=VALUE"):
        load_recipe(tmp_path / "r.yaml", PretrainRecipe, ["train.lr"])


def test_reference_mha_is_bundled_and_vllm_sized():
    """`reference-mha`: the MHA twin (8 KV heads x 64 = 1,024 cached values per token and layer), so vLLM's
    MLA size 512 + 64 is a compression of it; small enough to ship."""
    import json

    from attnkit.io.resolve import resolve_model

    folder = resolve_model("reference-mha")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"] == 8 and cfg["head_dim"] == 64
    assert 2 * cfg["num_key_value_heads"] * cfg["head_dim"] > 512 + 64
    assert sum(f.stat().st_size for f in folder.iterdir()) <= 25 * 2**20
    assert (folder / "tokenizer.json").is_file() and "MHA" in (folder / "README.md").read_text()
