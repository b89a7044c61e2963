"""Titans retrofit, the modeling side: the chunked memory update against the token-by-token
recurrence (autograd gradients), the window mask, exactness at conversion on every family, decoding
with the bounded cache against the full forward, and `generate` with batch > 1 and left padding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dex_models import FAMILIES, tiny_config
from transformers import AutoModelForCausalLM

from attnkit.adapters.titans import (
    SURPRISE_CLIP,
    MemoryState,
    TitansCache,
    TitansCacheLayer,
    memory_apply,
    memory_grads,
    memory_read_write,
    window_mask,
)
from attnkit.evaluation.kv import cache_bytes, run_for_cache

# ---------------------------------------------------------------- the memory update


def _loss(weights, k, v):
    return (memory_apply(weights, k)[0] - v).pow(2).sum()


def _token_by_token(state: MemoryState, q, tokens, chunk: int, start: int = 0):
    """The Titans recurrence one token at a time (gradients by autograd at the chunk's first weights):
    S_t = eta_t S_{t-1} - theta_t clip(grad l_t(M_chunk start)), M_t = (1 - alpha_t) M_{t-1} + S_t,
    clip: each weight's gradient scaled to Frobenius norm <= SURPRISE_CLIP."""
    weights, momentum = list(state.weights), list(state.momentum)
    anchor, reads = list(weights), []
    for t in range(q.shape[2]):
        if (start + t) % chunk == 0:
            anchor = list(weights)
        reads.append(memory_apply(anchor, q[:, :, t:t + 1])[0])
        # per (batch, head): its own gradient, its own gates
        params = [w.detach().clone().requires_grad_(True) for w in anchor]
        k, v = tokens["k"][:, :, t:t + 1], tokens["v"][:, :, t:t + 1]
        grads = [torch.stack([torch.stack([torch.autograd.grad(_loss([p[b, h] for p in params], k[b, h], v[b, h]), params)[i][b, h]
                                           for h in range(k.shape[1])]) for b in range(k.shape[0])])
                 for i in range(len(params))]
        eta = tokens["log_eta"][:, :, t].exp()[..., None, None]
        keep = tokens["log_keep"][:, :, t].exp()[..., None, None]
        theta = tokens["theta"][:, :, t][..., None, None]
        grads = [g * (SURPRISE_CLIP / g.norm(dim=(-2, -1), keepdim=True)).clamp(max=1.0) for g in grads]  # per token
        momentum = [eta * s - theta * g for s, g in zip(momentum, grads)]
        weights = [keep * w + s for w, s in zip(weights, momentum)]
    return (torch.cat(reads, dim=2) if reads else None), weights, momentum


def _random_inputs(batch, heads, dim, depth, length, seed):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    weights = [rand(batch, heads, dim, dim) / dim ** 0.5 for _ in range(depth)]
    state = MemoryState(weights, [0.1 * rand(batch, heads, dim, dim) for _ in range(depth)])
    norm = lambda x: torch.nn.functional.normalize(x, dim=-1)
    tokens = {"k": norm(rand(batch, heads, length, dim)), "v": rand(batch, heads, length, dim),
              "log_eta": torch.nn.functional.logsigmoid(rand(batch, heads, length)),
              "log_keep": torch.nn.functional.logsigmoid(rand(batch, heads, length) - 3),
              "theta": torch.sigmoid(rand(batch, heads, length))}
    return state, norm(rand(batch, heads, length, dim)), tokens


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 2), heads=st.integers(1, 2), dim=st.integers(2, 5), depth=st.integers(1, 3),
       chunk=st.integers(1, 5), length=st.integers(1, 11), seed=st.integers(0, 10_000))
def test_chunked_update_equals_token_by_token_recurrence(batch, heads, dim, depth, chunk, length, seed):
    state, q, tokens = _random_inputs(batch, heads, dim, depth, length, seed)
    reads, after, _ = memory_read_write(state, q, tokens, chunk)
    ref_reads, ref_weights, ref_momentum = _token_by_token(state, q, tokens, chunk)
    torch.testing.assert_close(reads, ref_reads, rtol=1e-9, atol=1e-9)
    # the state after the last complete chunk; the partial one waits in `pending`
    done = length - length % chunk
    _, w_done, s_done = _token_by_token(state, q[:, :, :done], {k: t[:, :, :done] for k, t in tokens.items()}, chunk)
    for got, want in zip(after.weights + after.momentum, w_done + s_done):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert all(t.shape[2] == length % chunk for t in after.pending.values())
    if length % chunk == 0:  # nothing pending: the full recurrence's state
        for got, want in zip(after.weights + after.momentum, ref_weights + ref_momentum):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@settings(max_examples=20, deadline=None)
@given(chunk=st.integers(1, 4), length=st.integers(2, 12), split=st.integers(1, 11), seed=st.integers(0, 10_000))
def test_reading_in_pieces_equals_reading_at_once(chunk, length, split, seed):
    split = min(split, length - 1)
    state, q, tokens = _random_inputs(2, 2, 3, 2, length, seed)
    whole, end, _ = memory_read_write(state, q, tokens, chunk)
    first, mid, _ = memory_read_write(state, q[:, :, :split], {k: t[:, :, :split] for k, t in tokens.items()}, chunk)
    second, end2, _ = memory_read_write(mid, q[:, :, split:], {k: t[:, :, split:] for k, t in tokens.items()}, chunk)
    torch.testing.assert_close(torch.cat([first, second], dim=2), whole, rtol=1e-10, atol=1e-10)
    for a, b in zip(end.tensors(), end2.tensors()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_memory_grads_are_the_weighted_sum_of_clipped_autograd_gradients():
    state, _, tokens = _random_inputs(1, 1, 4, 3, 6, seed=3)
    coef = torch.rand(1, 1, 6, dtype=torch.float64)
    (got,), _ = memory_grads(state.weights, tokens["k"], tokens["v"], [coef])
    want = [torch.zeros_like(w) for w in state.weights]
    clipped = 0
    for t in range(6):
        params = [w.clone().requires_grad_(True) for w in state.weights]
        loss = (memory_apply(params, tokens["k"][:, :, t:t + 1])[0] - tokens["v"][:, :, t:t + 1]).pow(2).sum()
        for acc, g in zip(want, torch.autograd.grad(loss, params)):
            clipped += int(g.norm() > SURPRISE_CLIP)
            acc += coef[0, 0, t] * g * min(1.0, SURPRISE_CLIP / float(g.norm()))
    assert clipped > 0  # the clip is exercised
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- the window


def test_window_mask_keeps_the_last_w_keys_and_padding():
    band = window_mask(None, 4, 6, 3, torch.float32, torch.device("cpu"))[0, 0] == 0  # 2 cached keys + 4 new
    want = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    want[0] = torch.tensor([1, 1, 1, 0, 0, 0], dtype=torch.bool)  # query 0 is key 2: keys 0..2
    want[1] = torch.tensor([0, 1, 1, 1, 0, 0], dtype=torch.bool)
    want[2] = torch.tensor([0, 0, 1, 1, 1, 0], dtype=torch.bool)
    want[3] = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool)
    assert torch.equal(band, want)
    padded = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    padded[..., 0] = False  # key 0 is padding
    assert torch.equal(window_mask(padded, 4, 6, 3, torch.float32, torch.device("cpu"))[0, 0], want & padded[0, 0])


# ---------------------------------------------------------------- models


def titans_model(family: str, window: int, chunk: int = 4, depth: int = 2, memory_dim: int | None = None,
                 impl: str = "eager", seed: int = 0, slots: int = 0, **kw):
    """(source, Titans model with the same weights), fp32, eval; the Titans ramp closed (0)."""
    import attnkit.adapters  # noqa: F401
    from attnkit.adapters.modeling_attnkit import CLASSES
    from attnkit.converters.titans.settings import titans_config_fields

    torch.manual_seed(seed)
    config = tiny_config(family, **kw)
    config._attn_implementation = impl
    source = AutoModelForCausalLM.from_config(config).float().eval()
    value_dim = config.v_head_dim if family == "deepseek_v3" else config.hidden_size // config.num_attention_heads
    fields = titans_config_fields({"window": window, "chunk": chunk, "memory_depth": depth,
                                   "memory_dim": memory_dim or value_dim, "sparse_slots": slots}, 0.25, family)
    plain = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
    config_class, model_class = CLASSES[family]
    target_config = config_class(**plain, attnkit=fields)
    target_config._attn_implementation = impl
    target = model_class(target_config).float().eval()
    result = target.load_state_dict(source.state_dict(), strict=False)
    assert not result.unexpected_keys and all(".titans." in k for k in result.missing_keys)
    return source, target


def open_memory(model, seed: int = 1) -> None:
    """Ramp 1 and a data-dependent, non-trivial gate: the memory really changes the output."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if hasattr(m, "mix") and hasattr(m, "ramp"):
            m.ramp.fill_(1.0)
            m.mix.weight.data.copy_(torch.randn(m.mix.weight.shape, generator=gen))
            m.mix.bias.data.zero_()


@pytest.mark.parametrize("family", FAMILIES)
def test_closed_gate_and_long_window_is_the_source(family):
    source, target = titans_model(family, window=64, chunk=8)
    ids = torch.randint(0, 300, (2, 37))
    with torch.no_grad():
        want, got = source(input_ids=ids).logits, target(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert torch.equal(got, want)


def test_closed_gate_is_the_source_with_a_sliding_window():
    """W < T, ramp 0: the same as transformers' own Mistral with sliding_window = W (same weights)."""
    _, target = titans_model("mistral", window=5, chunk=2)
    windowed = AutoModelForCausalLM.from_config(tiny_config("mistral")).float().eval()
    windowed.config.sliding_window = 5
    windowed.config._attn_implementation = "eager"
    windowed.load_state_dict(target.state_dict(), strict=False)
    ids = torch.randint(0, 300, (2, 23))
    with torch.no_grad():
        torch.testing.assert_close(target(input_ids=ids).logits, windowed(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
        source_full = _full_attention(windowed, ids)
    assert not torch.allclose(target(input_ids=ids).logits, source_full, atol=1e-3)  # the window matters


def _full_attention(model, ids):
    model.config.sliding_window = None
    try:
        return model(input_ids=ids).logits
    finally:
        model.config.sliding_window = 5


def decode_against_full(target, length: int, prompt: int, step: int = 1, opened: bool = True) -> TitansCache:
    """Open the memory (unless not `opened`), prefill `prompt` of 2 rows of `length` ids, decode the rest `step`
    tokens at a time with the cache; checks the logits against one forward without a cache; returns the cache."""
    if opened:
        open_memory(target)
    ids = torch.randint(0, 300, (2, length))
    with torch.no_grad():
        full = target(input_ids=ids, use_cache=False).logits
        out = target(input_ids=ids[:, :prompt], use_cache=True)
        cache, steps = out.cache, [out.logits]
        for t in range(prompt, length, step):
            steps.append(target(input_ids=ids[:, t:t + step], cache=cache, use_cache=True).logits)
    assert isinstance(cache, TitansCache)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    return cache


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_token_by_token_equals_the_full_forward(family):
    _, target = titans_model(family, window=6, chunk=4)
    cache = decode_against_full(target, 27, 7)
    assert all(layer.keys.shape[-2] == 5 for layer in cache.layers)  # W - 1 keys kept


def test_the_open_memory_changes_the_output_and_trains():
    _, target = titans_model("llama", window=4, chunk=2)
    ids = torch.randint(0, 300, (1, 20))
    with torch.no_grad():
        closed = target(input_ids=ids).logits
    open_memory(target)
    target.train()
    logits = target(input_ids=ids, use_cache=False).logits
    assert not torch.allclose(logits, closed, atol=1e-4)
    logits.logsumexp(-1).mean().backward()
    layer = target.model.layers[1].self_attn.titans
    for name in ("q_proj", "k_proj", "v_proj", "gates", "mix"):
        assert getattr(layer, name).weight.grad.abs().sum() > 0, name
    assert all(p.grad.abs().sum() > 0 for p in layer.initial)


def generate_left_padded(target, pad: tuple[int, int], new: int = 14):
    """Greedy `generate` of `new` tokens from 3 rows of 9 ids, rows 0 and 1 left-padded by `pad`; checks its
    scores against one forward over the whole sequences; returns (the generation, its full attention mask)."""
    open_memory(target)
    ids = torch.randint(2, 300, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :pad[0]] = mask[1, :pad[1]] = 0
    ids[mask == 0] = 0
    gen = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    full_mask = torch.cat([mask, torch.ones(3, new, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        full = target(input_ids=gen.sequences, attention_mask=full_mask, use_cache=False).logits
    torch.testing.assert_close(torch.stack(gen.scores, dim=1), full[:, ids.shape[1] - 1:-1], rtol=1e-5, atol=1e-5)
    return gen, full_mask


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_generate_with_left_padding_equals_the_full_forward(impl):
    _, target = titans_model("qwen2", window=6, chunk=4, impl=impl)
    gen, full_mask = generate_left_padded(target, (3, 1))
    cache = gen.past_key_values
    assert isinstance(cache, TitansCache) and all(isinstance(layer, TitansCacheLayer) for layer in cache.layers)
    assert all(layer.keys.shape == (3, 2, 5, 8) for layer in cache.layers)  # [B, G, W - 1, d]: bounded
    with torch.no_grad():  # what padding holds does not matter: not to the attention, not to the memory
        full = target(input_ids=gen.sequences, attention_mask=full_mask, use_cache=False).logits
        other = gen.sequences.clone()
        other[full_mask == 0] = 7
        full_other = target(input_ids=other, attention_mask=full_mask, use_cache=False).logits
    assert torch.equal(full_other[full_mask.bool()], full[full_mask.bool()])


def test_state_bytes_stop_growing_at_the_window():
    _, target = titans_model("llama", window=8, chunk=4)
    sizes = {n: sum(cache_bytes(run_for_cache(target, 1, n))) for n in (4, 5, 8, 18, 32, 35, 64)}
    assert sizes[4] < sizes[5] < sizes[8]  # below W: the window's keys/values grow
    assert sizes[8] == sizes[18] == sizes[32] == sizes[35] == sizes[64]  # whatever is pending in the chunk


def test_depth_zero_is_the_window_alone():
    """--memory-depth 0: no memory parameters, the same logits as a closed-gate Titans model, decoding
    equals the full forward, and the cache holds the window's keys/values only."""
    _, titans = titans_model("llama", window=6, chunk=4)
    _, window = titans_model("llama", window=6, chunk=4, depth=0)
    assert not [n for n, _ in window.named_parameters() if ".titans." in n]
    ids = torch.randint(0, 300, (2, 19))
    with torch.no_grad():
        full = window(input_ids=ids, use_cache=False).logits
        assert torch.equal(full, titans(input_ids=ids, use_cache=False).logits)
        out = window(input_ids=ids[:, :7], use_cache=True)
        steps = [out.logits] + [window(input_ids=ids[:, t:t + 1], cache=out.cache, use_cache=True).logits
                                for t in range(7, ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    sizes = {n: sum(cache_bytes(run_for_cache(window, 1, n))) for n in (6, 18)}
    assert sizes[6] == sizes[18] == 2 * 2 * 1 * 2 * 5 * 8 * 4  # layers x [K, V] x B x KV heads x (W - 1) x d x fp32


def test_a_closed_gate_without_a_cache_skips_the_memory(monkeypatch):
    """Ramp 0, use_cache=False: the memory is not computed (its output could not be mixed in), and the
    logits equal those of the run that computes it for the cache."""
    from attnkit.adapters import titans

    _, target = titans_model("llama", window=4, chunk=2)
    ids = torch.randint(0, 300, (2, 11))
    with torch.no_grad():
        with_cache = target(input_ids=ids, use_cache=True)
    assert all(layer.memory is not None for layer in with_cache.cache.layers)
    calls = []
    monkeypatch.setattr(titans, "memory_read_write", lambda *a: calls.append(1) or None)
    with torch.no_grad():
        assert torch.equal(target(input_ids=ids, use_cache=False).logits, with_cache.logits)
    assert not calls
