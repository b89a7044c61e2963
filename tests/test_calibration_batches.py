"""Calibration batches are sized by the attention's width (`calibration.rows_per_batch`): at most
TOKENS_PER_BATCH tokens and at most ATTENTION_BYTES of fp32 q, k, v states. A wider attention (the
DeepSeek-V3 layer of an MLA conversion) takes fewer rows at once; the statistics are the same up to
the order of the float sums."""

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig

from attnkit.converters import calibration
from attnkit.converters.calibration import (ATTENTION_BYTES, TOKENS_PER_BATCH, attention_token_bytes, batches,
                                            rows_per_batch)

LLAMA_1B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64)
# its MLA conversion at --kv-lora-rank 243 --rope-dim 64 (the 1B benchmark's): 64 + 64 q/k dims, 64 v dims
MLA_1B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=32, head_dim=64, q_lora_rank=2048,
              kv_lora_rank=243, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)


def test_token_bytes_are_the_q_k_v_of_every_head():
    assert attention_token_bytes(LlamaConfig(**LLAMA_1B)) == 4 * 32 * (64 + 64 + 64)  # k, v repeated to 32 heads
    assert attention_token_bytes(DeepseekV3Config(**MLA_1B)) == 4 * 32 * (128 + 128 + 64)
    assert attention_token_bytes(LlamaConfig(hidden_size=256, num_attention_heads=4)) == 4 * 4 * 3 * 64  # no head_dim


def test_rows_per_batch_by_width():
    llama, mla = attention_token_bytes(LlamaConfig(**LLAMA_1B)), attention_token_bytes(DeepseekV3Config(**MLA_1B))
    assert rows_per_batch(512) == 8  # no width given: 4,096 tokens, as before
    assert rows_per_batch(512, TOKENS_PER_BATCH, llama) == 2  # 1,365 tokens of 24 KiB fit: 2 rows
    assert rows_per_batch(512, TOKENS_PER_BATCH, mla) == 1  # 819 tokens of 40 KiB: 1 row
    for seq, token_bytes in [(512, mla), (256, mla), (128, llama), (100, 7 * llama), (64, 1000)]:
        rows = rows_per_batch(seq, TOKENS_PER_BATCH, token_bytes)
        assert rows * seq <= TOKENS_PER_BATCH and rows * seq * token_bytes <= ATTENTION_BYTES
        assert (rows + 1) * seq > min(TOKENS_PER_BATCH, ATTENTION_BYTES // token_bytes)  # the most that fit
    assert rows_per_batch(8192, TOKENS_PER_BATCH, mla) == 1  # one row at least
    assert rows_per_batch(64, 128) == 2 and rows_per_batch(64, 128, 16) == 2  # a narrow attention: the token cap
    assert [len(b) for b in batches(torch.zeros(5, 512, dtype=torch.long), TOKENS_PER_BATCH, llama)] == [2, 2, 1]


def _tiny_deepseek() -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, head_dim=8,
                           first_k_dense_replace=2, max_position_embeddings=128, attn_implementation="sdpa")
    return DeepseekV3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("budget_rows", [1, 2, 3])
def test_smaller_batches_give_the_same_statistics(monkeypatch, budget_rows):
    """The DeepSeek-V3 attention of a tiny MLA model: the statistics of 6 rows in one batch (the old
    token count) against batches of `budget_rows` rows (the byte budget lowered so that only that many
    fit): equal up to the order of the float sums."""
    model = _tiny_deepseek()
    rows = torch.randint(3, 100, (6, 40), generator=torch.Generator().manual_seed(1))
    token_bytes = attention_token_bytes(model.config)
    whole = calibration.calibrate(model, rows, torch.device("cpu"), tokens_per_batch=6 * 40)  # one batch: the budget holds it
    assert rows_per_batch(40, 6 * 40, token_bytes) == 6
    monkeypatch.setattr(calibration, "ATTENTION_BYTES", budget_rows * 40 * token_bytes)
    sizes = []
    split = calibration.batches
    monkeypatch.setattr(calibration, "batches", lambda *a: [sizes.append(len(b)) or b for b in split(*a)])
    small = calibration.calibrate(model, rows, torch.device("cpu"), tokens_per_batch=6 * 40)
    assert max(sizes) == budget_rows and sum(sizes) == 6
    for key in ("entropy", "head_rms"):
        assert torch.allclose(small[key], whole[key], rtol=1e-6, atol=0), (key, (small[key] - whole[key]).abs().max())


def test_held_out_batches_hold_one_block_of_attention_weights():
    """The held-out streams go through SDPA, whose CPU math path (a DeepSeek-V3 layer's: value heads
    narrower than query/key heads) holds [rows, H, T, T] fp32 weights: at most one BLOCK_BYTES of them."""
    from attnkit.converters.retrofit_stream import held_rows_per_batch

    mla, llama = DeepseekV3Config(**MLA_1B), LlamaConfig(**LLAMA_1B)
    assert held_rows_per_batch(mla, 512) == held_rows_per_batch(llama, 512) == 1  # 32 x 512 x 512 x 4 B = 32 MiB
    assert held_rows_per_batch(LlamaConfig(hidden_size=64, num_attention_heads=8, head_dim=8), 256) == 2  # 2 MiB a row
    assert held_rows_per_batch(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16), 64, 128) == 2  # token cap
    for heads, seq in [(8, 256), (32, 128), (16, 300), (4, 100)]:
        rows = held_rows_per_batch(LlamaConfig(hidden_size=heads * 8, num_attention_heads=heads), seq)
        assert rows == 1 or rows * 4 * heads * seq * seq <= calibration.BLOCK_BYTES  # one row at least
        assert rows * seq <= TOKENS_PER_BATCH
