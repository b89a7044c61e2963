"""KV-cache bytes per token are measured from the cache object; check them against the known layouts."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from attnkit.evaluation.kv import cache_bytes, kv_cache_bytes_per_token, run_for_cache


def _llama(layers: int, heads: int, kv_heads: int, head_dim: int, dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=100, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).to(dtype)


def _deepseek(layers: int, rank: int, rope: int, dtype=torch.float32) -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=8,
        v_head_dim=8, first_k_dense_replace=layers, n_routed_experts=2, max_position_embeddings=128,
    )
    return DeepseekV3ForCausalLM(cfg).to(dtype)


@settings(max_examples=6, deadline=None)
@given(
    layers=st.integers(1, 2),
    kv_heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([8, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_llama_gqa_is_2_layers_g_d_bytes(layers, kv_heads, head_dim, dtype):
    model = _llama(layers, 4, kv_heads, head_dim, dtype)
    got = kv_cache_bytes_per_token(model)
    per_layer = 2 * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    assert got["per_layer"] == [per_layer] * layers
    assert got["total"] == layers * per_layer
    assert got["layers"] == layers


@settings(max_examples=6, deadline=None)
@given(layers=st.integers(1, 2), rank=st.sampled_from([8, 12, 16]), rope=st.sampled_from([4, 8]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_deepseek_v3_stores_latent_plus_rope_key(layers, rank, rope, dtype):
    model = _deepseek(layers, rank, rope, dtype)
    got = kv_cache_bytes_per_token(model)
    bytes_ = torch.tensor([], dtype=dtype).element_size()
    assert got["total"] == (rank + rope) * layers * bytes_
    # what transformers' DeepSeek-V3 really stores: the normed latent as "keys", k_pe as "values", one head
    stored = got["stored"][0]["tensors"]
    assert stored["keys"]["shape"][1:] == [1, 12, rank]
    assert stored["values"]["shape"][1:] == [1, 12, rope]


def test_cache_bytes_scale_with_batch_and_tokens():
    model = _llama(1, 4, 2, 8).eval()
    assert cache_bytes(run_for_cache(model, 3, 5)) == [3 * 5 * 2 * 2 * 8 * 4]


def test_model_without_cache_is_refused():
    from attnkit.errors import AttnkitError

    with pytest.raises(AttnkitError, match="no KV cache"):
        cache_bytes(None)


def test_training_mode_is_restored():
    model = _llama(1, 4, 2, 8).train()
    kv_cache_bytes_per_token(model)
    assert model.training
