"""The teacher is held in its checkpoint's 16-bit dtype and computed in fp32 (`attnkit/training/frozen.py`):
its logits and every layer's output equal those of the same checkpoint loaded in fp32, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from attnkit.training import frozen
from attnkit.training.models import load_causal_lm
from attnkit.training.teacher import load_teacher


def _llama(heads: int, kv_heads: int, head_dim: int, bias: bool, tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, attention_bias=bias, max_position_embeddings=64,
        tie_word_embeddings=tie))


def _gemma2():  # a scaled embedding subclass, (1 + w) norms, attention and final logit softcapping
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8))


def _phi3():  # fused qkv and gate_up projections
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0))


def _qwen3():  # per-head q/k norms
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64))


def _saved(model: torch.nn.Module, folder: Path, dtype: torch.dtype) -> Path:
    with torch.no_grad():  # not the default init's small values only: every weight a little off its init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.to(dtype).save_pretrained(folder)
    return folder


def _same_outputs(folder: Path) -> torch.nn.Module:
    """load_teacher's model, checked against the fp32 load of the same checkpoint: logits and hidden states equal."""
    reference = load_causal_lm(folder, False).eval()
    teacher = load_teacher(folder, {}, "cpu")
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(input_ids=ids, output_hidden_states=True)
        got = teacher(input_ids=ids, output_hidden_states=True)
        got_base = teacher.base_model(input_ids=ids, output_hidden_states=True)  # the trainer's hidden-only call
    assert got.logits.dtype == torch.float32
    assert torch.equal(got.logits, want.logits)
    assert len(got.hidden_states) == len(want.hidden_states)
    assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, want.hidden_states))
    assert all(torch.equal(a, b) for a, b in zip(got_base.hidden_states, want.hidden_states))
    return teacher


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kv_heads=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([8, 12, 16]), bias=st.booleans(),
       tie=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_llama_teacher_in_16_bits_computes_the_fp32_outputs(tmp_path_factory, kv_heads, head_dim, bias, tie, dtype):
    torch.manual_seed(kv_heads * 100 + head_dim)
    folder = _saved(_llama(4, kv_heads, head_dim, bias, tie), tmp_path_factory.mktemp("llama"), dtype)
    assert frozen.storage_dtype(folder) == dtype
    teacher = _same_outputs(folder)
    assert {p.dtype for p in teacher.parameters()} == {dtype}  # held in 16 bits between calls


@pytest.mark.parametrize("build", [_gemma2, _phi3, _qwen3])
def test_other_families_in_bf16_compute_the_fp32_outputs(tmp_path, build):
    torch.manual_seed(0)
    folder = _saved(build(), tmp_path / "m", torch.bfloat16)
    teacher = _same_outputs(folder)
    assert {p.dtype for p in teacher.parameters()} == {torch.bfloat16}


def test_an_fp32_or_mixed_checkpoint_is_held_in_fp32(tmp_path):
    torch.manual_seed(0)
    folder = _saved(_llama(4, 2, 8, False, True), tmp_path / "f32", torch.float32)
    assert frozen.storage_dtype(folder) == torch.float32
    assert {p.dtype for p in load_teacher(folder, {}, "cpu").parameters()} == {torch.float32}
    # one tensor left in fp32 in a bf16 checkpoint: loading it in bf16 would round it, so fp32 it stays
    mixed = _saved(_llama(4, 2, 8, False, True), tmp_path / "mixed", torch.bfloat16)
    shard = mixed / "model.safetensors"
    tensors = load_file(str(shard))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].float() + 1e-3
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert frozen.storage_dtype(mixed) == torch.float32
    _same_outputs(mixed)


def test_weights_not_in_safetensors_are_read_in_fp32_as_before(tmp_path):
    torch.manual_seed(0)
    _llama(4, 2, 8, False, False).to(torch.bfloat16).save_pretrained(tmp_path / "bin")
    stored = tmp_path / "bin" / "model.safetensors"  # the same weights as pytorch_model.bin
    torch.save(load_file(str(stored)), tmp_path / "bin" / "pytorch_model.bin")
    stored.unlink()
    assert frozen.storage_dtype(tmp_path / "bin") == torch.float32
    assert {p.dtype for p in load_teacher(tmp_path / "bin", {}, "cpu").parameters()} == {torch.float32}


def _student_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    with frozen.saved_in_low_precision():
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("build", [lambda: _llama(4, 2, 16, True, False), _phi3])
def test_student_frozen_in_bf16_trains_as_in_fp32(tmp_path, build):
    """`hold_frozen`: the frozen parameters back in the checkpoint's bf16, the trained ones fp32: the same
    loss and gradients bit for bit, and the backward keeps no fp32 copy of a frozen weight alive."""
    torch.manual_seed(0)
    folder = _saved(build(), tmp_path / "m", torch.bfloat16)
    trained = ("self_attn",)  # the attention trains, the rest (MLPs, norms, embeddings, head) is frozen
    models = []
    for hold in (False, True):
        model = load_causal_lm(folder, False).train()
        for name, p in model.named_parameters():
            p.requires_grad_(any(t in name for t in trained))
        if hold:
            assert frozen.hold_frozen(model, torch.bfloat16) > 0
        models.append(model)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    packed = []
    real_pack = frozen._pack
    frozen._pack = lambda t: packed.append(real_pack(t)) or packed[-1]  # what the backward keeps
    try:
        (loss_a, grads_a), (loss_b, grads_b) = (_student_step(m, ids) for m in models)
    finally:
        frozen._pack = real_pack
    assert loss_a == loss_b
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    assert {p.dtype for p in models[1].parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in models[1].parameters() if p.requires_grad} == {torch.float32}
    kept = [x for x in packed if isinstance(x, tuple)]  # frozen weights kept as their bf16 parameters
    assert kept and all(x[0].dtype == torch.bfloat16 for x in kept)
    assert not frozen._SOURCES  # every fp32 copy let go after its module's forward
