"""Tiny random source models of every supported family, saved as HF folders (no download)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config,
                          Phi3ForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

TEXT = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # value {i}\n" for i in range(200)]

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=100, max_position_embeddings=256)


def family_model(kind: str, seed: int = 0, **over):
    """(model, config) for kind in llama, llama3, mistral, qwen2, phi3, smollm, mha, mqa."""
    torch.manual_seed(seed)
    kw = dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if kind == "llama":
        cls, cfg = LlamaForCausalLM, LlamaConfig(**{**kw, **over})
    elif kind == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        cls, cfg = LlamaForCausalLM, LlamaConfig(**{**kw, "rope_parameters": rope, **over})
    elif kind == "smollm":
        cls, cfg = LlamaForCausalLM, LlamaConfig(**{**kw, "tie_word_embeddings": True, **over})
    elif kind == "mha":
        cls, cfg = LlamaForCausalLM, LlamaConfig(**{**kw, "num_key_value_heads": 4, **over})
    elif kind == "mqa":
        cls, cfg = LlamaForCausalLM, LlamaConfig(**{**kw, "num_key_value_heads": 1, **over})
    elif kind == "mistral":
        cls, cfg = MistralForCausalLM, MistralConfig(**{**kw, "sliding_window": None, **over})
    elif kind == "qwen2":
        cls, cfg = Qwen2ForCausalLM, Qwen2Config(**{**kw, **over})
    elif kind == "phi3":
        kw.pop("head_dim")
        cls, cfg = Phi3ForCausalLM, Phi3Config(**{**kw, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **over})
    else:
        raise ValueError(kind)
    model = cls(cfg).eval()
    with torch.no_grad():  # random biases (Qwen2's are zero-initialised) so that bias handling is tested
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    return model, cfg


def tokenizer(vocab_size: int = 100) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60)
    tok.train_from_iterator(TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_model(folder: Path, kind: str, dtype=torch.float32, **over) -> Path:
    model, _ = family_model(kind, **over)
    model.to(dtype).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def calib_folder(folder: Path, n_docs: int = 60) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        (folder / f"doc{i:03d}.txt").write_text("".join(TEXT[(i * 7 + j) % len(TEXT)] for j in range(12)))
    return folder


def logits_rel(a_path, b_path) -> float:
    """Relative logits error of model folder b against a (fp32, the same random ids)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ids = torch.randint(3, 100, (2, 40))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(a_path, dtype=torch.float32).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(b_path, dtype=torch.float32).eval()(ids).logits
    return float((a - b).norm() / a.norm())
