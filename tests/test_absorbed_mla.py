"""Absorbed MLA attention is numerically the expanded (transformers) path, over a latent cache."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

from attnkit.adapters.mla import LatentLayer, disable_absorbed, enable_absorbed, is_mla, split_kv_b
from attnkit.errors import AttnkitError
from attnkit.evaluation.kv import kv_cache_bytes_per_token

TOL = 1e-4


def _model(interleave=False, bias=False, q_lora=None, layers=2, seed=0) -> DeepseekV3ForCausalLM:
    """A dense DeepSeek-V3 with weights large enough that attention is far from uniform."""
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=q_lora, kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=6, first_k_dense_replace=layers, n_routed_experts=2, max_position_embeddings=256,
        rope_interleave=interleave, attention_bias=bias,
    )
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.25)
            elif bias:
                p.normal_(0, 0.1)  # biases and norm weights: exercise them too
    return model


def _pair(mode="absorbed", **kw):
    ref = _model(**kw)
    return ref, enable_absorbed(copy.deepcopy(ref), mode)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _left_padded(batch: int, seq: int, pads: list[int], seed=1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for i, p in enumerate(pads):
        mask[i, :p] = 0
        ids[i, :p] = 0
    return ids, mask


@settings(max_examples=10, deadline=None)
@given(
    interleave=st.booleans(), bias=st.booleans(), q_lora=st.sampled_from([None, 10]),
    batch=st.integers(1, 3), seq=st.sampled_from([1, 2, 5, 9, 17, 24]), pad=st.booleans(),
    mode=st.sampled_from(["absorbed", "expanded"]),
)
def test_logits_match_expanded_path(interleave, bias, q_lora, batch, seq, pad, mode):
    """Whole-prompt forward: folded heads (≤ 16 rows) and SDPA-GQA (longer) absorbed, and SDPA expanded."""
    ref, absorbed = _pair(mode, interleave=interleave, bias=bias, q_lora=q_lora)
    pads = [min(i, seq - 1) for i in range(batch)] if pad else [0] * batch
    ids, mask = _left_padded(batch, seq, pads)
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = absorbed(ids, attention_mask=mask).logits
    keep = mask.bool()  # padded query rows are undefined in both paths
    assert _rel(got[keep], want[keep]) < TOL


@pytest.mark.parametrize("mode", ["absorbed", "auto", "expanded"])
@pytest.mark.parametrize("interleave", [False, True])
def test_incremental_decode_logits_match(mode, interleave):
    """Prefill then token-by-token decode, past 2x the prompt length, batch 2 with left padding."""
    ref, absorbed = _pair(mode, interleave=interleave, bias=True, q_lora=10)
    ids, mask = _left_padded(2, 6, [0, 2])
    caches = [DynamicCache(config=ref.config), DynamicCache(config=ref.config)]
    step_ids, step_mask = ids, mask
    with torch.no_grad():
        for _ in range(14):
            outs = [m(step_ids, attention_mask=step_mask, cache=c, use_cache=True).logits[:, -1]
                    for m, c in zip((ref, absorbed), caches)]
            assert _rel(outs[1], outs[0]) < TOL
            step_ids = outs[0].argmax(-1, keepdim=True)
            step_mask = torch.cat([step_mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    assert all(isinstance(layer, LatentLayer) for layer in caches[1].layers)
    assert caches[1].get_seq_length() == 6 + 13


@pytest.mark.parametrize("mode", ["absorbed", "auto"])
def test_greedy_generation_identical(mode):
    ref, absorbed = _pair(mode, interleave=True, bias=True)
    ids, mask = _left_padded(3, 5, [0, 1, 3])
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want, got = ref.generate(ids, **kw), absorbed.generate(ids, **kw)
    assert got.shape[1] > 2 * ids.shape[1]
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["absorbed", "expanded"])
@pytest.mark.parametrize("chunk", [3, 18])
def test_chunked_prefill_through_cache(mode, chunk):
    """A multi-token call on top of a filled cache (chunked prefill): causal mask built for Q < S."""
    ref, absorbed = _pair(mode, q_lora=10)
    ids = torch.randint(1, 97, (2, 20 + chunk), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = [m(ids[:, 20:], cache=m(ids[:, :20], use_cache=True).cache).logits for m in (absorbed, ref)]
    assert _rel(got, want) < TOL


def test_auto_rule_absorbs_decode_and_expands_long_prefill():
    _, absorbed = _pair("auto")
    attn = absorbed.model.layers[0].self_attn
    assert attn.use_absorbed(1, 4096)
    assert not attn.use_absorbed(4096, 4096)


def test_beam_search_reorders_latent_cache():
    ref, absorbed = _pair(interleave=False)
    ids, mask = _left_padded(2, 4, [0, 1])
    kw = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(absorbed.generate(ids, **kw), ref.generate(ids, **kw))


def test_plain_cache_converted_and_disable_restores():
    """A cache filled by transformers' own path is taken over; disable_absorbed reads a latent cache."""
    ref, absorbed = _pair()
    ids = torch.randint(1, 97, (1, 5))
    nxt = torch.randint(1, 97, (1, 1))
    with torch.no_grad():
        want = ref(nxt, cache=ref(ids, use_cache=True).cache).logits
        plain = ref(ids, use_cache=True).cache  # DynamicLayers holding c_kv / k_pe
        got = absorbed(nxt, cache=plain).logits
        assert _rel(got, want) < TOL
        latent = absorbed(ids, use_cache=True).cache
        disable_absorbed(absorbed)
        assert _rel(absorbed(nxt, cache=latent).logits, want) < TOL


def test_latent_layer_grows_in_blocks_and_crops():
    layer = LatentLayer()
    chunks = [torch.randn(2, 1, n, 12) for n in (200, 100, 1)], [torch.randn(2, 1, n, 8) for n in (200, 100, 1)]
    for c, k in zip(*chunks):
        c_view, k_view = layer.update(c, k)
    assert layer.get_seq_length() == 301
    assert torch.equal(c_view[:, 0], torch.cat([c[:, 0] for c in chunks[0]], dim=1))
    assert torch.equal(k_view[:, 0], torch.cat([k[:, 0] for k in chunks[1]], dim=1))
    assert layer.stored_bytes() == 2 * 301 * 20 * 4
    assert layer.allocated_bytes() == 2 * 512 * 20 * 4
    layer.crop(-1)
    assert layer.get_seq_length() == 300
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.fused().shape == (1, 300, 20)


@pytest.mark.parametrize("mode", ["absorbed", "auto"])
def test_cache_bytes_are_latent_plus_rope(mode):
    _, absorbed = _pair(mode, layers=2)
    got = kv_cache_bytes_per_token(absorbed)
    assert got["total"] == (12 + 8) * 2 * 4
    assert got["layer_class"] == "LatentLayer"


def test_split_kv_b_matches_module_layout():
    model = _model()
    attn = model.model.layers[0].self_attn
    w_uk, w_uv = split_kv_b(attn.kv_b_proj.weight, 4, 8, 6)
    c = torch.randn(3, 12)
    kv = attn.kv_b_proj(c).view(3, 4, 14)
    assert torch.allclose(kv[..., :8], torch.einsum("hnr,tr->thn", w_uk, c), atol=1e-6)
    assert torch.allclose(kv[..., 8:], torch.einsum("hvr,tr->thv", w_uv, c), atol=1e-6)


def test_bad_input():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert not is_mla(llama)
    with pytest.raises(AttnkitError, match="no MLA layers"):
        enable_absorbed(llama)
    with pytest.raises(AttnkitError, match="unknown MLA attention mode"):
        enable_absorbed(_model(), "fast")
