"""Titans' sparse slots (`--sparse-slots S`): per layer and KV head, the exact keys/values of the S most
surprising tokens the window has lost. The choice against a brute-force reference, S = 0 and S >= T
against the window and full attention, decoding and `generate` with left padding against the full
forward, and a state that stops growing at W + S."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_titans import decode_against_full, generate_left_padded, titans_model

from attnkit.adapters.titans import Slots, admit, slot_mask
from attnkit.evaluation.kv import cache_bytes, run_for_cache


def _slots_by_hand(pos: list[int], score: list[float], q: int, window: int, slots: int) -> set[int]:
    """The tokens query position q keeps: of those gone from its window with a known surprise, the
    `slots` highest (on a tie, the later)."""
    gone = [j for j in range(len(pos)) if pos[j] <= q - window and score[j] == score[j] and score[j] != float("-inf")]
    return set(sorted(gone, key=lambda j: (score[j], pos[j]), reverse=True)[:slots])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 14), window=st.integers(1, 5), slots=st.integers(0, 6), data=st.data())
def test_slot_mask_keeps_the_most_surprising_tokens_gone_from_the_window(n, window, slots, data):
    values = st.sampled_from([0.0, 0.5, 1.0, 2.0, float("nan"), float("-inf")])  # ties, unknown, padding
    score = data.draw(st.lists(values, min_size=n, max_size=n))
    pos = sorted(data.draw(st.lists(st.integers(0, 30), min_size=n, max_size=n, unique=True)))
    q_pos = sorted(data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=5, unique=True)))
    got = slot_mask(torch.tensor(q_pos), torch.tensor(pos)[None, None], torch.tensor(score)[None, None], window, slots)
    for i, q in enumerate(q_pos):
        assert set(torch.nonzero(got[0, 0, i]).flatten().tolist()) == _slots_by_hand(pos, score, q, window, slots)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 16), window=st.integers(1, 4), slots=st.integers(1, 5), data=st.data())
def test_admitting_tokens_as_they_leave_the_window_keeps_what_slot_mask_keeps(n, window, slots, data):
    """Decoding's store, updated one token at a time, holds after token t exactly the slots of the query
    that token t has just left (position t + W), as ranked at once by `slot_mask`."""
    values = st.sampled_from([0.0, 0.5, 1.0, 2.0, float("nan"), float("-inf")])
    score = data.draw(st.lists(values, min_size=n, max_size=n))
    store = Slots(torch.zeros(1, 1, slots, 2), torch.zeros(1, 1, slots, 3), torch.full((1, 1, slots), -1),
                  torch.full((1, 1, slots), float("-inf")))
    for t in range(n):
        key = torch.full((1, 1, 2), float(t))
        store = admit(store, key, torch.full((1, 1, 3), float(t)), t, torch.tensor([[score[t]]]))
        held = torch.isfinite(store.score[0, 0])
        assert set(store.pos[0, 0][held].tolist()) == _slots_by_hand(list(range(n)), score, t + window, window, slots)
        assert torch.equal(store.k[0, 0, held, 0], store.pos[0, 0][held].float())  # each key beside its position
        assert torch.equal(store.v[0, 0, held, 0], store.pos[0, 0][held].float())


def test_no_slots_and_slots_that_never_fill_are_the_window_alone():
    ids = torch.randint(0, 300, (2, 21))
    _, plain = titans_model("llama", window=6, chunk=2)
    _, slotted = titans_model("llama", window=6, chunk=2, slots=4)
    _, wide = titans_model("llama", window=32, chunk=2, slots=4)  # W > T: nothing ever leaves the window
    _, wide_plain = titans_model("llama", window=32, chunk=2)
    with torch.no_grad():
        assert torch.equal(wide(input_ids=ids).logits, wide_plain(input_ids=ids).logits)
        assert not torch.allclose(slotted(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_as_many_slots_as_tokens_is_full_attention(family):
    """S >= T, gate closed: every token the window lost is kept, so the model is its full-attention source."""
    source, target = titans_model(family, window=4, chunk=2, slots=32)
    ids = torch.randint(0, 300, (2, 23))
    with torch.no_grad():
        torch.testing.assert_close(target(input_ids=ids).logits, source(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("step", [1, 2])
def test_decoding_token_by_token_equals_the_full_forward(family, step):
    """One token a step takes the decoding path (`admit`); two a step rank inside the step (`slot_mask`)."""
    _, target = titans_model(family, window=5, chunk=3, slots=3)
    cache = decode_against_full(target, 29, 9, step=step)
    assert all(layer.slots.k.shape[2] == 3 and torch.isfinite(layer.slots.score).all() for layer in cache.layers)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_generate_with_left_padding_equals_the_full_forward(impl):
    _, target = titans_model("qwen2", window=4, chunk=2, slots=3, impl=impl)
    gen, _ = generate_left_padded(target, (5, 1), new=12)
    for layer in gen.past_key_values.layers:  # padding is never kept
        kept = layer.slots.pos[0][torch.isfinite(layer.slots.score[0])]
        assert (kept >= 5).all()


def test_state_stops_growing_at_the_window_with_slots():
    """The S slots are held from the first token on, so the state is flat from W on, larger than the
    window's alone by the slots' keys, values, positions and surprises and the window's surprises."""
    _, target = titans_model("llama", window=8, chunk=4, slots=5)
    _, plain = titans_model("llama", window=8, chunk=4)
    sizes = {n: sum(cache_bytes(run_for_cache(target, 1, n))) for n in (4, 8, 13, 20, 37, 64)}
    assert sizes[4] < sizes[8] == sizes[13] == sizes[20] == sizes[37] == sizes[64]
    layers, kv_heads, head_dim = 2, 2, 8
    slots = layers * kv_heads * 5 * (2 * head_dim * 4 + 8 + 4)  # keys, values (fp32), position (int64), surprise
    scores = layers * kv_heads * 7 * 4  # the window's W - 1 surprises
    assert sizes[64] == sum(cache_bytes(run_for_cache(plain, 1, 64))) + slots + scores


def _titans_modules(model):
    return [m for m in model.modules() if type(m).__name__ == "TitansMemory"]


def test_a_slot_bias_shifts_only_the_slots():
    """`slot_bias` b adds b to a slot's attention logit: 0 is the slots as chosen, a very negative b the
    window alone (the window's keys are never shifted), and decoding still equals the full forward."""
    ids = torch.randint(0, 300, (2, 21))
    _, plain = titans_model("llama", window=6, chunk=2)
    _, slotted = titans_model("llama", window=6, chunk=2, slots=4)
    with torch.no_grad():
        unbiased = slotted(input_ids=ids).logits
        for module in _titans_modules(slotted):
            module.slot_bias = -1e4
        torch.testing.assert_close(slotted(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        for module in _titans_modules(slotted):
            module.slot_bias = -1.5
        biased = slotted(input_ids=ids).logits
    assert not torch.allclose(biased, unbiased, atol=1e-4)
    assert not torch.allclose(biased, plain(input_ids=ids).logits, atol=1e-4)
    _, target = titans_model("qwen2", window=5, chunk=3, slots=3, impl="sdpa")
    for module in _titans_modules(target):
        module.slot_bias = -1.5
    decode_against_full(target, 23, 7, step=2)


def test_a_shut_gate_reads_nothing_and_decodes_like_the_full_forward():
    """Ramp 0 at inference: the memory only writes (the slots' surprise), its queries are never computed,
    and the logits equal those of a run that reads it (grad enabled reads, then gates the reads out)."""
    _, target = titans_model("qwen2", window=5, chunk=3, slots=3, impl="sdpa")
    for module in _titans_modules(target):
        module.slot_bias, module.mix_memory = -1.0, False
    ids = torch.randint(0, 300, (2, 19))
    calls = []
    for module in _titans_modules(target):
        module.q_proj.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        skipped = target(input_ids=ids).logits
    assert not calls
    with torch.enable_grad():
        read = target(input_ids=ids).logits.detach()
    assert calls and torch.equal(skipped, read)
    decode_against_full(target, 31, 6, step=1, opened=False)


def test_a_shut_gate_stays_shut_through_the_schedule():
    """`memory_mix: false`: the fine-tune's schedule leaves the ramp at 0, so the memory only chooses slots."""
    from attnkit.training.schedules import broadcast_step

    _, target = titans_model("llama", window=6, chunk=2, slots=4)
    ids = torch.randint(0, 300, (2, 21))
    with torch.no_grad():
        before = target(input_ids=ids).logits
    for module in _titans_modules(target):
        module.mix_memory = False
    broadcast_step(target, 40, 40)
    assert all(float(m.ramp) == 0.0 for m in _titans_modules(target))
    with torch.no_grad():
        assert torch.equal(target(input_ids=ids).logits, before)
