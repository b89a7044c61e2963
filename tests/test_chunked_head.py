"""The cross-entropy run over the LM head a chunk of positions at a time (`attnkit/training/chunked_head.py`)
is the whole-logits loss: its value and its gradients (to the hidden states and to a trained head) agree to
float rounding, soft-capped like Gemma's or not; and the trainer uses it only where the model's logits are
its head's output."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.training import chunked_head
from attnkit.training.losses import next_token_ce as whole_ce

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import family_model  # noqa: E402


def _both(batch, length, width, vocab, rows, bias, softcap, block=None):
    """(chunked, whole) losses and gradients of the same hidden states and head."""
    gen = torch.Generator().manual_seed(batch * 1000 + length * 10 + vocab)
    hidden = torch.randn(batch, length, width, generator=gen) * 3
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    head = torch.nn.Linear(width, vocab, bias=bias)
    out = []
    for chunked in (True, False):
        h = hidden.clone().requires_grad_(True)
        head.zero_grad()
        if chunked:
            loss = chunked_head.next_token_ce(h, ids, head, softcap, chunk_bytes=rows * 4 * vocab,
                                              block_bytes=None if block is None else block * 4 * width)
        else:
            logits = head(h)
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            loss = whole_ce(logits, ids)
        loss.backward()
        out.append((loss.detach(), h.grad, head.weight.grad.clone()))
    return out


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(2, 40), width=st.sampled_from([8, 16, 24]),
       vocab=st.integers(5, 300), rows=st.integers(1, 50), bias=st.booleans(),
       softcap=st.sampled_from([None, 5.0, 30.0]), block=st.one_of(st.none(), st.integers(1, 300)))
def test_chunked_cross_entropy_is_the_whole_logits_one(batch, length, width, vocab, rows, bias, softcap, block):
    """Chunks of positions, and the head in blocks of vocabulary rows (`block`: rows per block; None: the default
    64 MiB, one block here)."""
    (loss, g_h, g_w), (loss0, g_h0, g_w0) = _both(batch, length, width, vocab, rows, bias, softcap, block)
    assert torch.allclose(loss, loss0, rtol=1e-6, atol=1e-6)
    assert torch.allclose(g_h, g_h0, rtol=1e-5, atol=1e-7)
    assert torch.allclose(g_w, g_w0, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_head_upcast_block_by_block_computes_what_its_fp32_copy_does(dtype):
    """A frozen head held in 16 bits is upcast a block of vocabulary rows at a time, never whole: the loss and
    the gradient to the hidden states are those of the same head stored in fp32, bit for bit (the same blocks)."""
    torch.manual_seed(0)
    low = torch.nn.Linear(24, 1000, bias=False).to(dtype).requires_grad_(False)
    full = torch.nn.Linear(24, 1000, bias=False).requires_grad_(False)
    full.weight.copy_(low.weight.float())
    hidden, ids = torch.randn(2, 33, 24), torch.randint(0, 1000, (2, 33))
    out = []
    for head in (low, full):
        h = hidden.clone().requires_grad_(True)
        loss = chunked_head.next_token_ce(h, ids, head, chunk_bytes=7 * 4 * 1000, block_bytes=64 * 4 * 24)  # 16 blocks
        loss.backward()
        out.append((loss.detach(), h.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert low.weight.dtype == dtype and low.weight.grad is None


def test_the_logits_of_one_chunk_at_a_time():
    """A 4,000-entry vocabulary over 300 positions in chunks of 10 positions: no more than a chunk's logits
    are alive in the forward (the saved tensors are the inputs, not [positions, vocabulary])."""
    head = torch.nn.Linear(16, 4000, bias=False)
    hidden = torch.randn(1, 301, 16, requires_grad=True)
    ids = torch.randint(0, 4000, (1, 301))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        chunked_head.next_token_ce(hidden, ids, head, chunk_bytes=10 * 4 * 4000)
    assert max(saved) < 300 * 4000 / 10


@pytest.mark.parametrize("kind", ["llama", "phi3", "qwen2", "smollm"])
def test_final_hidden_stops_before_the_head_and_matches(kind):
    model, _ = family_model(kind)
    ids = torch.randint(3, 100, (2, 12))
    head = chunked_head.head_of(model)
    assert head is not None and chunked_head.matches(model, ids)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        with chunked_head.final_hidden(head) as kept:
            out = model(input_ids=ids, output_hidden_states=True)
    assert out.logits.shape[1] == 0 and kept.hidden.shape == (2, 12, model.config.hidden_size)
    assert torch.allclose(head(kept.hidden), logits, atol=1e-5)
    assert torch.allclose(chunked_head.next_token_ce(kept.hidden, ids, head), whole_ce(logits, ids), atol=1e-6)


def test_gemma2_soft_capping_and_a_rescaling_head():
    """Gemma-2 soft-caps its final logits: matched here. A config that rescales them (Cohere's logit_scale)
    keeps the whole-logits path; a model whose forward changes the head's output fails the check."""
    from transformers import CohereConfig, Gemma2Config, Gemma2ForCausalLM

    small = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    gemma = Gemma2ForCausalLM(Gemma2Config(**small, final_logit_softcapping=3.0)).eval()
    assert chunked_head.softcap_of(gemma) == 3.0 and chunked_head.matches(gemma, torch.randint(0, 128, (1, 8)))
    cohere = torch.nn.Module()
    cohere.config = CohereConfig(**small, logit_scale=0.0625)
    cohere.get_output_embeddings = lambda: torch.nn.Linear(32, 128)
    assert chunked_head.head_of(cohere) is None
    model, _ = family_model("llama")
    model.forward = _doubled(model.forward)
    assert not chunked_head.matches(model, torch.randint(3, 100, (1, 8)))


def _doubled(forward):
    def run(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out
    return run



def test_under_autocast_the_head_runs_in_its_dtype_with_its_bias():
    """A bf16 run (CPU autocast here, as on GPUs): the chunked loss is the whole-logits loss under the same
    autocast, bias included, to bf16 rounding."""
    head = torch.nn.Linear(16, 50, bias=True)
    with torch.no_grad():
        head.bias.normal_(0, 3)
    hidden, ids = torch.randn(2, 9, 16), torch.randint(0, 50, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = chunked_head.next_token_ce(hidden, ids, head, chunk_bytes=3 * 4 * 50)
        whole = whole_ce(head(hidden), ids)
    assert torch.allclose(chunked, whole, rtol=2e-2) and not torch.allclose(chunked, whole_ce(hidden @ head.weight.T, ids), rtol=2e-2)


def test_a_forward_that_skips_its_head_is_not_matched():
    """A model whose forward never calls the module `get_output_embeddings` names (here: another head) keeps
    the whole-logits path instead of failing in training."""
    model, _ = family_model("llama")
    spare = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    model.get_output_embeddings = lambda: spare
    assert not chunked_head.matches(model, torch.randint(3, 100, (1, 8)))
