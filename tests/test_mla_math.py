"""Exactness of the MLA math against transformers' own attention modules (fp32, tiny shapes)."""

import torch
from hypothesis import given, settings, strategies as st
from transformers import LlamaConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from attnkit.converters.mla import layer as mla
from attnkit.adapters.families import FAMILIES
from attnkit.converters.mla.native import constant_for, deepseek_config, native_attention_tensors
from attnkit.converters.mla.rope import exact_rope_parameters, source_rope, target_rope


def _source(G, groups, d, bias, seed):
    torch.manual_seed(seed)
    H, D = G * groups, 32
    cfg = LlamaConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=G, head_dim=d,
                      attention_bias=bias, vocab_size=10, intermediate_size=8)
    cfg._attn_implementation = "sdpa"
    attn = LlamaAttention(cfg, 0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 12, D)
    pos = torch.arange(12)
    with torch.no_grad():
        ref = attn(x, position_embeddings=LlamaRotaryEmbedding(cfg)(x, pos[None]), attention_mask=None)[0]
    aw = mla.AttnWeights(attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach(),
                         attn.o_proj.weight.detach(), *(None if not bias else getattr(attn, n).bias.detach()
                                                        for n in ("q_proj", "k_proj", "v_proj", "o_proj")))
    flat = torch.cat([x.reshape(-1, D), torch.ones(24, 1)], 1).double()
    return cfg, aw, mla.Shape(D, H, G, d), x, pos, ref, flat.T @ flat / 24


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@settings(max_examples=8, deadline=None)
@given(G=st.sampled_from([1, 2, 4]), groups=st.sampled_from([1, 2]), d=st.sampled_from([4, 8]),
       bias=st.booleans(), method=st.sampled_from(["rorope", "partial"]), seed=st.integers(0, 99),
       rope_share=st.sampled_from([0.5, 1.0]))
def test_full_rank_stages_are_exact(G, groups, d, bias, method, seed, rope_share):
    """At d_r = G d everything is exact; at smaller d_r every step after the RoPE one is exact with
    respect to it (so compare against the rope stage)."""
    cfg, aw, shape, x, pos, ref, mom = _source(G, groups, d, bias, seed)
    inv, att = source_rope(FAMILIES["llama"], cfg)
    d_r = max(2, int(G * d * rope_share) // 2 * 2)
    rope_ref = ref
    if d_r < G * d:
        plan = mla.plan_rope(aw, mom, shape, d_r, method, inv)
        kw = dict(scale_src=d**-0.5, scale_tgt=(d + d_r) ** -0.5)
        with torch.no_grad():
            rope_ref = mla.mla_attention(mla.to_dtype(mla.build_stage(aw, plan, shape, mom, **kw), torch.float32), x, pos)
    plan = mla.plan_rope(aw, mom, shape, d_r, method, inv)
    kw = dict(scale_src=d**-0.5, scale_tgt=(d + d_r) ** -0.5)
    full = mla.identity_plan(shape, inv)
    for stage in (mla.build_stage(aw, full, shape, mom, **{**kw, "scale_tgt": (d + G * d) ** -0.5}),
                  mla.build_stage(aw, plan, shape, mom, beta=2.5, **kw),
                  mla.build_stage(aw, plan, shape, mom, beta=2.5, rank=2 * G * d - d_r, **kw),
                  mla.build_stage(aw, plan, shape, mom, beta=0.7, rank=2 * G * d - d_r, **kw,
                                  metrics=mla.attention_metrics(aw, mla.split_keys(aw, plan, shape), shape, mom))):
        with torch.no_grad():
            out = mla.mla_attention(mla.to_dtype(stage, torch.float32), x, pos)
        target = ref if stage.pe_w.shape[0] == G * d else rope_ref
        assert _rel(out, target) < 1e-5


@settings(max_examples=6, deadline=None)
@given(G=st.sampled_from([1, 2]), groups=st.sampled_from([1, 2]), d=st.sampled_from([4, 8]),
       bias=st.booleans(), seed=st.integers(0, 99))
def test_native_deepseek_layer_matches_stage(G, groups, d, bias, seed):
    """transformers' DeepseekV3Attention with the constant latent channel equals the math (and the source)."""
    cfg, aw, shape, x, pos, ref, mom = _source(G, groups, d, bias, seed)
    inv, att = source_rope(FAMILIES["llama"], cfg)
    d_r = G * d
    plan = mla.plan_rope(aw, mom, shape, d_r, "rorope", inv)
    rank = 2 * G * d - d_r + 1
    dcfg = deepseek_config(cfg.to_dict(), shape, d_r, rank, shape.D + 1 if bias else None,
                           exact_rope_parameters(plan.inv_freq, 10000.0, 256, att), "float32")
    dcfg._attn_implementation = "sdpa"
    assert torch.allclose(target_rope(dcfg)[0], plan.inv_freq, rtol=1e-6)
    p = mla.build_stage(aw, plan, shape, mom, scale_src=d**-0.5, scale_tgt=DeepseekV3Attention(dcfg, 0).scaling,
                        beta=1.7, rank=rank - 1)
    lat = x.reshape(-1, shape.D).double() @ p.lat_w.T + p.lat_b
    t = native_attention_tensors(p, shape, constant_for(lat.norm(dim=-1).max(), torch.float32),
                                 constant_for(x.norm(dim=-1).max(), torch.float32))
    native = DeepseekV3Attention(dcfg, 0).eval()
    native.load_state_dict({k: v.float() for k, v in t.items()}, strict=True)
    with torch.no_grad():
        out = native(x, position_embeddings=DeepseekV3RotaryEmbedding(dcfg)(x, pos[None]), attention_mask=None)[0]
    assert _rel(out, ref) < 1e-5


def test_truncation_is_lossy_and_monotone():
    cfg, aw, shape, x, pos, ref, mom = _source(2, 2, 8, False, 0)
    inv, _ = source_rope(FAMILIES["llama"], cfg)
    errs = []
    for d_r in (4, 8, 16):
        plan = mla.plan_rope(aw, mom, shape, d_r, "rorope", inv)
        assert plan.kept_i.numel() == d_r // 2
        p = mla.build_stage(aw, plan, shape, mom, scale_src=8**-0.5, scale_tgt=(8 + d_r) ** -0.5)
        errs.append(_rel(mla.mla_attention(mla.to_dtype(p, torch.float32), x, pos), ref))
    assert errs[0] > 1e-3 and errs[-1] < 1e-5


def test_slot_counts_respect_budget_and_group_size():
    scores = [torch.rand(8, 3) for _ in range(4)]
    counts = mla.slot_counts(scores, 10)
    assert int(counts.sum()) == 5 and int(counts.max()) <= 3
