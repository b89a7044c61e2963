"""Pure helpers of benchmarks/compat_transformers.py (no venv is built, no old transformers run).

The cross-version measurement itself is in docs/compat.md; here: the legacy keys are what 4.x needs,
and writing them changes nothing for the transformers 5 this suite runs with.
"""
import json

import numpy as np
import pytest
from conftest import load_benchmark
import torch

from attnkit.converters.mla.legacy import min_transformers


LONGROPE = {"rope_type": "longrope", "factor": 1.0, "rope_theta": 10000.0, "long_factor": [1.0, 0.5, 0.25, 2.0],
            "short_factor": [1.0, 0.5, 0.25, 2.0], "original_max_position_embeddings": 4096,
            "attention_factor": 1.0}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
DEFAULT = {"rope_type": "default", "rope_theta": 50000.0}


@pytest.fixture(scope="module")
def ct():
    return load_benchmark("compat_transformers.py", "bench_compat_transformers")


def test_default_rope_writes_theta_and_null_scaling(ct):
    out = ct.legacy_fields({"rope_parameters": dict(DEFAULT), "q_lora_rank": None, "dtype": "bfloat16"})
    assert out == {"rope_theta": 50000.0, "rope_scaling": None, "torch_dtype": "bfloat16"}


def test_longrope_mirrors_parameters_with_factor(ct):
    rp = {k: v for k, v in LONGROPE.items() if k not in ("factor", "attention_factor")}
    cfg = {"rope_parameters": rp, "dtype": "float32", "torch_dtype": "float32"}
    out = ct.legacy_fields(cfg)
    assert out["rope_theta"] == 10000.0
    sc = out["rope_scaling"]
    # 4.x's attention reads rope_scaling["factor"]; the attention factor is explicit; theta stays top level
    assert sc["factor"] == 1.0 and sc["attention_factor"] == 1.0 and "rope_theta" not in sc
    assert sc["long_factor"] == rp["long_factor"] and sc["rope_type"] == "longrope"
    assert "torch_dtype" not in out  # already there
    assert cfg["rope_parameters"] == rp  # pure


def test_yarn_keeps_its_parameters(ct):
    sc = ct.legacy_fields({"rope_parameters": dict(YARN)})["rope_scaling"]
    assert sc == {k: v for k, v in YARN.items() if k != "rope_theta"}


def test_config_with_only_rope_scaling_is_understood(ct):
    out = ct.legacy_fields({"rope_scaling": {"type": "yarn", "factor": 2.0}, "rope_theta": 1e6})
    assert out["rope_theta"] == 1e6 and out["rope_scaling"] == {"rope_type": "yarn", "factor": 2.0}


def test_tokenizer_class(ct):
    assert ct.legacy_tokenizer_fields({"tokenizer_class": "TokenizersBackend"}) == {
        "tokenizer_class": "PreTrainedTokenizerFast"}
    assert ct.legacy_tokenizer_fields({}) == {"tokenizer_class": "PreTrainedTokenizerFast"}
    assert ct.legacy_tokenizer_fields({"tokenizer_class": "LlamaTokenizerFast"}) == {}


def test_min_version(ct):
    assert min_transformers({"rope_parameters": dict(DEFAULT), "q_lora_rank": None}) == "4.53.0"
    assert min_transformers({"rope_parameters": dict(LONGROPE), "q_lora_rank": 64}) == "4.51.0"
    # yarn: before 4.56 the factor is replaced by max_position_embeddings / original_max_position_embeddings
    assert min_transformers({"rope_parameters": dict(YARN), "max_position_embeddings": 4096,
                                "q_lora_rank": 64}) == "4.51.0"
    assert min_transformers({"rope_parameters": dict(YARN), "max_position_embeddings": 8192,
                                "q_lora_rank": 64}) == "4.56.0"
    assert min_transformers({"rope_parameters": {**YARN, "truncate": False}, "max_position_embeddings": 4096,
                                "q_lora_rank": None}) == "4.56.0"


def test_compare_logits(ct):
    ref = np.array([[1.0, 2.0, 3.0], [3.0, 0.0, 4.0]])
    same = ct.compare_logits(ref.copy(), ref)
    assert same["max_rel"] == 0.0 and same["argmax_agree"] == 1.0
    off = ct.compare_logits(ref + np.array([[0.0, 0.0, 0.0], [0.0, 5.0, 0.0]]), ref)
    assert off["max_rel"] == pytest.approx(1.0) and off["mean_rel"] == pytest.approx(0.5)
    assert off["argmax_agree"] == 0.5
    assert "max_rel" not in ct.compare_logits(ref[:1], ref)


def test_summarise_names_the_reason(ct):
    assert ct.summarise({"error": "ValueError: boom"}, 1e-4) == "ValueError: boom"
    row = {"tokenizer_error": "ValueError: no class", "logits": {"max_rel": 0.18}}
    s = ct.summarise(row, 1e-4)
    assert "tokenizer" in s and "0.18" in s
    assert ct.summarise({"ids_match": True, "logits": {"max_rel": 1e-7}}, 1e-4) == "ok"


@pytest.mark.parametrize("rp", [DEFAULT, LONGROPE, YARN, LLAMA3], ids=lambda r: r["rope_type"])
def test_legacy_fields_change_nothing_in_transformers_5(ct, rp, tmp_path):
    """transformers 5 takes `rope_scaling` over `rope_parameters` when both are in config.json: the
    legacy keys must rebuild exactly the same RoPE frequencies, attention factor and softmax scale."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    base = {"model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
            "num_hidden_layers": 1, "first_k_dense_replace": 1, "n_routed_experts": 1, "n_group": 1,
            "topk_group": 1, "num_experts_per_tok": 1, "intermediate_size": 64, "moe_intermediate_size": 64,
            "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
            "v_head_dim": 16, "vocab_size": 32, "max_position_embeddings": 4096, "rope_parameters": dict(rp)}

    def build(cfg: dict):
        d = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        c = AutoConfig.from_pretrained(d)
        rot = DeepseekV3RotaryEmbedding(c)
        return rot.inv_freq.double(), float(rot.attention_scaling), float(DeepseekV3Attention(c, 0).scaling)

    inv0, att0, sc0 = build(base)
    inv1, att1, sc1 = build({**base, **ct.legacy_fields(base)})
    assert torch.equal(inv0, inv1) and att0 == att1 and sc0 == sc1
