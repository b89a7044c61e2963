"""SDPA with different q/k and v head sizes: the zero padding that keeps PyTorch's fused kernels
changes no output, alone and as the attention of a transformers DeepSeek-V3 model."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, DeepseekV3Config

from attnkit.sdpa import ATTENTION, implementation_for, sdpa


def _reference(q, k, v, scale, mask):
    """Attention written out (scores materialised), the definition the fused call must meet."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    return (scores.softmax(-1) @ v.double()).float()


@settings(max_examples=40, deadline=None)
@given(heads=st.integers(1, 4), t=st.integers(1, 33), dqk=st.integers(1, 40), dv=st.integers(1, 40),
       explicit_scale=st.booleans(), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_padded_sdpa_is_attention(heads, t, dqk, dv, explicit_scale, causal, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, heads, t, dqk, generator=g), torch.randn(2, heads, t, dqk, generator=g)
    v = torch.randn(2, heads, t, dv, generator=g)
    scale = 0.37 if explicit_scale else None
    mask = torch.ones(t, t, dtype=torch.bool).tril() if causal else torch.ones(t, t, dtype=torch.bool)
    out = sdpa(q, k, v, scale=scale, is_causal=causal)
    assert out.shape == (2, heads, t, dv)
    ref = _reference(q, k, v, scale if explicit_scale else dqk**-0.5, mask)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def _tiny_deepseek(**kw) -> DeepseekV3Config:
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=2, n_shared_experts=1, num_experts_per_tok=1,
                first_k_dense_replace=2, n_group=1, topk_group=1, max_position_embeddings=128)
    return DeepseekV3Config(**{**base, **kw})


@pytest.mark.parametrize("v_head_dim", [16, 40])  # v smaller than q/k (24), then larger
def test_registered_attention_matches_eager_in_a_deepseek_model(tmp_path, v_head_dim):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_tiny_deepseek(v_head_dim=v_head_dim)).save_pretrained(tmp_path)
    config = {"model_type": "deepseek_v3", "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": v_head_dim}
    name = implementation_for(config)
    assert name == ATTENTION
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    fused = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation=name).eval()
    assert fused.config._attn_implementation == ATTENTION
    ids = torch.randint(0, 97, (2, 21))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: the mask path, not only is_causal
    with torch.no_grad():
        a, b = eager(ids, attention_mask=mask).logits, fused(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(b[keep], a[keep], rtol=1e-5, atol=1e-5)


def test_only_mla_configs_with_unequal_head_sizes_get_it():
    assert implementation_for({"model_type": "llama", "head_dim": 64}) is None
    assert implementation_for({"model_type": "deepseek_v3", "qk_nope_head_dim": 48, "qk_rope_head_dim": 16,
                               "v_head_dim": 64}) is None
    assert implementation_for({"model_type": "deepseek_v3", "qk_nope_head_dim": 64, "qk_rope_head_dim": 48,
                               "v_head_dim": 64}) == ATTENTION
