"""Tiny random models of every DEX/DIFF source family, saved with a small tokenizer (no downloads).

Imported by the other test_dex*/test_diff* files; its own tests check the builders.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

VOCAB = 300
CALIB_TEXT = "\n".join(
    f"def f{i}(x, y):\n    return x * {i} + y - {i % 7}  # value {i}\nclass C{i}: pass\n" for i in range(200)
)


def tiny_config(family: str, hidden: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2):
    common = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "deepseek_v3":
        common.update(num_key_value_heads=heads)
        return DeepseekV3Config(
            **common,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=hidden // heads,
            v_head_dim=hidden // heads,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=layers,
            rope_interleave=False,
        )
    raise ValueError(family)


FAMILIES = ["llama", "mistral", "qwen2", "deepseek_v3"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([CALIB_TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def save_tiny_model(folder: Path, family: str, seed: int = 0, **kw) -> Path:
    """A random model of `family` with a tokenizer, in `folder`; returns the folder."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kw)).float()
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def write_calib(folder: Path) -> Path:
    """A calibration folder with several documents (so both splits have text)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(40):
        (folder / f"doc{i}.txt").write_text(CALIB_TEXT[i * 300 :] + CALIB_TEXT[: i * 300])
    return folder


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    """A calibration text folder shared by a test module."""
    return write_calib(tmp_path_factory.mktemp("calib"))


def test_tiny_models_build(tmp_path):
    for family in FAMILIES:
        folder = save_tiny_model(tmp_path / family, family)
        assert json.loads((folder / "config.json").read_text())["model_type"] == family
    tok = tiny_tokenizer()
    assert len(tok) <= VOCAB and tok.eos_token_id is not None


def retrofit_pair(family: str, method: str, seed: int = 0, selected=None, **kw):
    """(source model, attnkit model with the same weights) in eval mode, fp32, in memory."""
    import attnkit.adapters  # noqa: F401  (registers the classes)
    from attnkit.adapters.modeling_attnkit import CLASSES
    from attnkit.converters.dex.heads import dex_config_fields
    from attnkit.converters.diff.layer import diff_config_fields

    torch.manual_seed(seed)
    config = tiny_config(family, **kw)
    source = AutoModelForCausalLM.from_config(config).float().eval()
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    if method == "diff":
        fields = diff_config_fields(0.25, family, layers)
    else:
        fields = dex_config_fields(selected or [list(range(heads))] * layers, 0.25, family)
    fields_config = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
    config_class, model_class = CLASSES[family]
    target = model_class(config_class(**fields_config, attnkit=fields)).float().eval()
    result = target.load_state_dict(source.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert all((".dex." in k or ".diff" in k) for k in result.missing_keys)
    return source, target


def set_step(model, step: int, total: int) -> None:
    for module in model.modules():
        if hasattr(module, "attnkit_set_step"):
            module.attnkit_set_step(step, total)


def convert_cli(to: str, src: Path, out: Path, calib: Path, *extra: str) -> int:
    from attnkit.cli import main

    return main(["convert", "--to", to, str(src), "-o", str(out), "--calib", str(calib),
                 "--calib-tokens", "1024", "--calib-seq-len", "32", *extra])


FRESH_LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
ids = torch.load(sys.argv[1])
logits = []
for folder in sys.argv[3:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__name__.startswith("Attnkit"), type(model)
    with torch.no_grad():
        logits.append(model(input_ids=ids).logits)
assert "attnkit" not in sys.modules, "the saved modeling code must not need attnkit"
torch.save(logits, sys.argv[2])
"""


def fresh_process_logits(folders: list[Path], ids: torch.Tensor, tmp: Path) -> list[torch.Tensor]:
    """Logits of each folder loaded with trust_remote_code in ONE new Python process (attnkit not imported)."""
    import os
    import subprocess
    import sys

    torch.save(ids, tmp / "ids.pt")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp / "hf_modules"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", FRESH_LOAD, str(tmp / "ids.pt"), str(tmp / "logits.pt"), *map(str, folders)],
        capture_output=True, text=True, env=env, cwd=tmp, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return torch.load(tmp / "logits.pt")
