"""Calibration statistics of the in-place retrofits (`--to dex | diff | titans | mla+…`), in memory
bounded by one block of query rows.

Per layer and head: the mean normalised attention entropy (DEX's head score, `dex/heads.py`) and the
mean RMS of the head output (DIFF's norm initialisation, `diff/layer.py`). The entropy needs the
attention probabilities, which eager attention materialises whole ([B, H, T, T] per layer, kept alive
by autograd when the pass runs with a graph: ~2 GB per calibration batch on the 4-layer reference).
Here the attention itself is replaced, for the calibration pass only, by a function that computes
softmax(QKᵀ)·V a block of query rows at a time and folds each block's entropy into running sums, so
the peak is one [B, H, rows, S] block whatever T is, and nothing outlives its block.

What a batch holds besides grows with its tokens and the attention's width: the query, key and value
states of every head (and the projections around them). So a batch is sized in bytes of those states,
not in tokens: at most TOKENS_PER_BATCH tokens and at most ATTENTION_BYTES of fp32 q, k and v
(`rows_per_batch`). A source layer of Llama-3.2-1B's width (32 heads of 64) takes 1,365 tokens (two
rows of 512), the DeepSeek-V3 layer of its MLA conversion (queries and keys of 64 + 64 rope dims,
32 heads) 819 (one row). The batch's other activations are a few times its q, k, v (the projections
and latents, RoPE copies, the attention output), so they shrink with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from attnkit.converters.dex.heads import normalized_entropy
from attnkit.converters.diff.layer import head_rms
from attnkit.errors import AttnkitError

ATTENTION = "attnkit_calibration"
TOKENS_PER_BATCH = 4096  # calibration tokens pushed through a layer at once, at most
ATTENTION_BYTES = 32 * 2**20  # fp32 q, k, v states of every head in one calibration batch, at most
BLOCK_BYTES = 4 * 2**20  # one block of fp32 scores [B, H, rows, S]; the entropy's fp64 temporaries are 4x


class EntropyStats:
    """Running per-layer sums of normalised attention entropy [H] and their counts."""

    def __init__(self, layers: int):
        self.sums: list[torch.Tensor | float] = [0.0] * layers
        self.counts = [0] * layers

    def add(self, layer: int, probs: torch.Tensor, first_query: int) -> None:
        s, n = normalized_entropy(probs, first_query)
        self.sums[layer] = self.sums[layer] + s
        self.counts[layer] += n

    def attention(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  softcap: float | None = None, **_kwargs) -> tuple[torch.Tensor, None]:
        """A transformers attention function: eager attention's arithmetic, a block of query rows at a
        time, recording each block's entropy. query [B, H, T, dq], key [B, G, S, dq], value [B, G, S, dv]."""
        bsz, heads, t_len, dq = query.shape
        s_len = key.shape[-2]
        groups = heads // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)  # [B, H, S, dq]
        value = value.repeat_interleave(groups, dim=1)  # [B, H, S, dv]
        scale = dq**-0.5 if scaling is None else scaling
        rows = max(1, BLOCK_BYTES // (4 * bsz * heads * s_len))
        out = query.new_empty(bsz, heads, t_len, value.shape[-1])
        for t0 in range(0, t_len, rows):
            t1 = min(t_len, t0 + rows)
            # in place where eager attention makes a copy: the same operations, one block fewer alive
            scores = torch.matmul(query[:, :, t0:t1], key.transpose(-1, -2)).mul_(scale)  # [B, H, r, S]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if attention_mask is not None:
                block = attention_mask[:, :, t0:t1, :s_len]  # [B, 1, r, S]
                scores = scores.masked_fill_(~block, float("-inf")) if block.dtype == torch.bool else scores.add_(block)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            del scores
            self.add(module.layer_idx, probs, s_len - t_len + t0)
            out[:, :, t0:t1] = torch.matmul(probs, value)
        return out.transpose(1, 2).contiguous(), None  # [B, T, H, dv]

    def means(self) -> torch.Tensor:
        if any(c == 0 for c in self.counts):
            raise AttnkitError("calibration saw no attention in some layer (sequence length must be at least 2)")
        return torch.stack([s / c for s, c in zip(self.sums, self.counts)]).float()  # [L, H]


class CalibrationStats:
    """Both statistics of every layer: the entropy (from the calibration attention function) and the
    RMS of each head's output (from a pre-hook on `o_proj`, whose input is the heads' outputs)."""

    def __init__(self, layers: int, heads: int):
        self.entropy = EntropyStats(layers)
        self.heads = heads
        self.rms_sum: list[torch.Tensor | float] = [0.0] * layers
        self.rms_count = [0] * layers

    def hook(self, attn: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
        layer = attn.layer_idx

        def on_o_proj(_module, inputs):
            x = inputs[0]
            s, n = head_rms(x.view(*x.shape[:-1], self.heads, -1))  # [B, T, H·d_v] -> [B, T, H, d_v]
            self.rms_sum[layer] = self.rms_sum[layer] + s
            self.rms_count[layer] += n

        return attn.o_proj.register_forward_pre_hook(on_o_proj)

    def result(self) -> dict:
        if any(c == 0 for c in self.rms_count):
            raise AttnkitError("calibration saw no attention output in some layer")
        rms = torch.stack([s / c for s, c in zip(self.rms_sum, self.rms_count)]).float()  # [L, H]
        return {"entropy": self.entropy.means(), "head_rms": rms}


@contextmanager
def calibration_attention(stats: CalibrationStats, config, modules: list[torch.nn.Module]) -> Iterator[None]:
    """While open, attention modules reading `config` run the calibration attention function and
    `modules` (attention modules with an `o_proj`) feed their head outputs to `stats`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION, stats.entropy.attention)
    AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    previous = config._attn_implementation
    hooks = [stats.hook(a) for a in modules]
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous
        for h in hooks:
            h.remove()


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")]


@torch.no_grad()  # statistics only: a graph would keep every block and activation of the batch alive
def calibrate(model, rows: torch.Tensor, device: torch.device, tokens_per_batch: int = TOKENS_PER_BATCH) -> dict:
    """Per layer and head: mean normalised attention entropy and mean RMS of the head output, from
    `rows` [N, T] of calibration tokens run through the whole `model` in batches of ~`tokens_per_batch`
    (the conversions stream one layer at a time instead: `converters/retrofit_stream.py`)."""
    stats = CalibrationStats(model.config.num_hidden_layers, model.config.num_attention_heads)
    with calibration_attention(stats, model.config, attention_modules(model)):
        for batch in tqdm(batches(rows, tokens_per_batch, attention_token_bytes(model.config)), desc="calibration",
                          unit="batch", leave=False):
            model(input_ids=batch.to(device), use_cache=False)
    return stats.result()


def attention_token_bytes(config) -> int:
    """fp32 bytes per token of the query, key and value states of every head, as the calibration
    attention function holds them (keys and values repeated to the query heads). The query/key head
    width is DeepSeek-V3's `qk_head_dim` (no-rope + rope dims) where the config has one, else `head_dim`."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    qk = getattr(config, "qk_head_dim", None) or head_dim
    v = getattr(config, "v_head_dim", None) or head_dim
    return 4 * heads * (2 * int(qk) + int(v))


def rows_per_batch(seq_len: int, tokens_per_batch: int = TOKENS_PER_BATCH, token_bytes: int | None = None) -> int:
    """Rows of `seq_len` tokens per calibration batch: at most `tokens_per_batch` tokens and, given the
    attention's `token_bytes` (`attention_token_bytes`), at most ATTENTION_BYTES of its states; one row
    at least."""
    tokens = tokens_per_batch if token_bytes is None else min(tokens_per_batch, ATTENTION_BYTES // token_bytes)
    return max(1, tokens // seq_len)


def batches(rows: torch.Tensor, tokens_per_batch: int = TOKENS_PER_BATCH, token_bytes: int | None = None) -> list[torch.Tensor]:
    """Split [N, T] rows into batches of `rows_per_batch` rows."""
    return list(rows.split(rows_per_batch(rows.shape[1], tokens_per_batch, token_bytes)))
