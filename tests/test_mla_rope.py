"""The exported config's RoPE frequencies, as transformers computes them, equal the kept ones."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from transformers import LlamaConfig

from attnkit.converters.mla import layer as mla
from attnkit.adapters.families import FAMILIES
from attnkit.converters.families import describe
from attnkit.converters.mla.native import deepseek_config
from attnkit.converters.mla.rope import (exact_rope_parameters, geometric_rope_parameters, served_rope_parameters,
                                        source_rope, target_rope)
from attnkit.errors import AttnkitError

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}


def _cfg(rope):
    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=10,
                       intermediate_size=8, max_position_embeddings=256, rope_parameters=dict(rope))


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_exact_frequencies_roundtrip_through_transformers(kind):
    cfg = _cfg(ROPES[kind])
    inv, att = source_rope(FAMILIES["llama"], cfg)
    kept = torch.tensor([0, 0, 1, 3, 3, 7, 5])  # any multiset, repeats included
    params = exact_rope_parameters(inv[kept], ROPES[kind]["rope_theta"], 256, att)
    d_r = 2 * kept.numel()
    tgt = deepseek_config(cfg.to_dict(), mla.Shape(64, 4, 2, 16), d_r, 9, None, params, "float32")
    t_inv, t_att = target_rope(tgt)
    assert torch.allclose(t_inv, inv[kept], rtol=1e-6)
    assert t_att == pytest.approx(att)  # 1.0 unless the source (yarn) scales attention
    assert tgt.head_dim == d_r and tgt.qk_nope_head_dim == 16 and tgt.v_head_dim == 16


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_geometric_mode_keeps_the_source_ladder_at_full_head_dim(kind):
    cfg = _cfg(ROPES[kind])
    inv, att = source_rope(FAMILIES["llama"], cfg)
    tgt = deepseek_config(cfg.to_dict(), mla.Shape(64, 4, 2, 16), 16, 9, None,
                          geometric_rope_parameters(dict(cfg.rope_parameters)), "float32")
    t_inv, t_att = target_rope(tgt)
    assert torch.allclose(t_inv, inv, rtol=1e-6) and t_att == pytest.approx(att)


@pytest.mark.parametrize("config, words", [
    ({"model_type": "gemma2"}, "softcapping"),
    ({"model_type": "gemma3"}, "multimodal"),
    ({"model_type": "gpt2"}, "supported are"),
    ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "sequence length"),
])
def test_refusals_name_the_reason(config, words):
    with pytest.raises(AttnkitError, match=words):
        describe(config)


@settings(max_examples=60, deadline=None)
@given(theta=st.floats(2.0, 1e9), half=st.integers(1, 256), max_pos=st.integers(1, 1 << 21))
def test_served_ladder_is_the_default_ladder_bit_for_bit(theta, half, max_pos):
    """The engine form's `yarn` factor 1.0 (what vLLM computes right) is the plain ladder in transformers:
    the same frequencies bit for bit, attention factor 1 and the same softmax scale."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    plain = {"rope_type": "default", "rope_theta": theta}
    served = served_rope_parameters(plain, max_pos)
    assert served["rope_type"] == "yarn" and served["factor"] == 1.0
    shape = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, qk_rope_head_dim=2 * half,
                 qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=8, q_lora_rank=None, max_position_embeddings=max_pos)
    a, b = DeepseekV3Config(**shape, rope_parameters=plain), DeepseekV3Config(**shape, rope_parameters=served)
    (inv_a, att_a), (inv_b, att_b) = target_rope(a), target_rope(b)
    assert torch.equal(inv_a, inv_b) and att_a == att_b == 1.0
    with torch.device("meta"):
        assert DeepseekV3Attention(a, 0).scaling == DeepseekV3Attention(b, 0).scaling


def test_served_rope_leaves_other_types():
    assert served_rope_parameters(ROPES["llama3"], 4096) == ROPES["llama3"]
