"""Tiny models, tokenizer, corpus and recipes for the finetune tests (no downloads, seconds to build)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml

WORDS = "def return self import class for in if else while yield lambda None True False print len range".split()


def write_corpus(path: Path, n_docs: int = 300, seed: int = 0) -> Path:
    """A JSONL corpus of pseudo-Python lines (enough for train and the 5 % validation split)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n_docs):
            lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) for _ in range(rng.randint(3, 6))]
            f.write(json.dumps({"text": "\n".join(lines)}) + "\n")
    return path


def build_tokenizer(corpus: Path, vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def save_llama(folder: Path, tokenizer, seed: int = 0, layers: int = 1, tie: bool = True) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        tie_word_embeddings=tie, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_deepseek(folder: Path, tokenizer, seed: int = 1, layers: int = 1, **extra) -> Path:
    """A dense DeepSeek-V3 (MLA) like `attnkit convert --to mla` writes (`extra`: more DeepseekV3Config fields)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=64,
        num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        max_position_embeddings=128, rope_interleave=False,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **extra,
    )
    DeepseekV3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_recipe(path: Path, **sections) -> Path:
    path.write_text(yaml.safe_dump(sections, sort_keys=False))
    return path


def base_recipe(tmp: Path, student: Path, teacher: Path | None, corpus: Path, out: str = "out") -> dict:
    return {
        "model": str(student),
        "teacher": str(teacher) if teacher else None,
        "output_dir": str(tmp / out),
        "data": {"source": str(corpus), "seq_len": 16, "tokens": 16 * 8 * 6, "val_tokens": 64, "seed": 0},
        "train": {
            "trainable": "full", "per_device_batch_size": 4, "lr": 1.0e-2, "warmup_steps": 1,
            "schedule": "cosine", "mixed_precision": "no", "seed": 0,
        },
        "loss": {"ce_weight": 0.5, "kl_weight": 1.0 if teacher else 0.0, "temperature": 2.0},
        "log": {"tensorboard": False},
    }


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """corpus, tokenizer, a Llama teacher and a DeepSeek-V3 student sharing the tokenizer."""
    root = tmp_path_factory.mktemp("finetune")
    corpus = write_corpus(root / "corpus.jsonl")
    tok = build_tokenizer(corpus)
    return {
        "root": root,
        "corpus": corpus,
        "tokenizer": tok,
        "llama": save_llama(root / "llama", tok),
        "mla": save_deepseek(root / "mla", tok),
    }
