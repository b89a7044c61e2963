"""Absorbed MLA attention over a latent KV cache, for decoding DeepSeek-V3-format (converted) models.

transformers' `DeepseekV3Attention` caches the latent (`c_kv` after `kv_a_layernorm`, and `k_pe`) but
re-expands `kv_b_proj` over the whole cache at every step: cost ∝ context × H × (d_nope + d_v) × r.
Absorption (DeepSeek-V2 §2.1.2) never materialises per-head K/V:

    score_h(t) = q_nope_h · (W_UK_h c_t) + q_pe_h · k_pe_t = (W_UK_hᵀ q_nope_h) · c_t + q_pe_h · k_pe_t
    out_h      = W_UV_h · Σ_t p_h(t) c_t

so attention is MQA with one shared "head" [c | k_pe] of width r + d_r (values: c, width r). When decoding,
the H query heads fold into the rows of one SDPA call, so each layer streams its cache once per step.

`enable_absorbed(model)` swaps the class of every `DeepseekV3Attention` (weights, names and state dict
unchanged); `model.generate` then uses it with a standard `DynamicCache` whose layers become
`LatentLayer`s (one fused [B, S, r + d_r] tensor per layer, grown in blocks instead of `torch.cat`).
A sliding-window layer of the source (Gemma-3's, in the attnkit format) becomes a `SlidingLatentLayer`,
which keeps only the latents of the window, as transformers' `DynamicSlidingWindowLayer` keeps keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

try:
    from attnkit.errors import AttnkitError
except ImportError:  # shipped inside an attnkit-format checkpoint (auto_map), where attnkit may be absent
    AttnkitError = ValueError

MODES = ("auto", "absorbed", "expanded")
# calls with at most this many new tokens fold the heads into query rows (decode, short chunks)
FOLD_MAX_QUERY = 16
# SDPA runs the absorbed prefill (one shared K/V head of width r + d_r, enable_gqa) ~10 % slower per
# multiply-add than the expanded one on CPU: measured with `python benchmarks/prefill_rule.py --threads 1`
ABSORBED_KERNEL_FACTOR = 1.1
_BLOCK = 256  # latent cache capacity grows in blocks of this many tokens


class LatentLayer(DynamicLayer):
    """A dynamic cache layer holding one fused latent [B, S, r + d_r] per layer (c_kv then k_pe).

    It speaks transformers' DeepSeek-V3 protocol — `update(c_kv [B,1,Q,r], k_pe [B,1,Q,d_r])` returns
    views of the whole cache in the same layout — so the expanded path works on it too, and
    `fused()` gives the absorbed path the [B, S, r + d_r] tensor it multiplies against directly.
    Capacity grows in blocks of `_BLOCK` tokens (amortised O(1) append, at most `_BLOCK` tokens slack).
    """

    def __init__(self, **kwargs):
        self._buf: torch.Tensor | None = None  # [B, capacity, r + d_r]; the stored tokens are [_start, _len)
        self._start = 0  # > 0 only in a sliding layer, whose oldest latents are dropped
        self._len = 0
        self.rank = 0
        super().__init__(**kwargs)

    # `keys` is the fused view of the stored tokens; DynamicLayer's crop/select/reorder/offload work on it
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._buf is None else self._buf[:, self._start : self._len]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._buf = value
        self._start = 0
        self._len = 0 if value is None else value.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:  # everything lives in `keys`; a zero-width view keeps shapes
        return None if self._buf is None else self._buf[:, self._start : self._len, :0]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        pass

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.rank = key_states.shape[-1]
        width = self.rank + value_states.shape[-1]
        self._buf = key_states.new_empty(key_states.shape[0], 0, width)
        self._start = self._len = 0
        self.is_initialized = True

    def append(self, fused: torch.Tensor) -> None:
        """Append fused latents [B, Q, r + d_r]; reallocates only when the block capacity is exceeded
        (a sliding layer first moves its kept latents to the front when that makes room)."""
        need = self._len + fused.shape[1]
        if self._buf.shape[0] != fused.shape[0] or need > self._buf.shape[1] or not self._buf.is_contiguous():
            kept = self._len - self._start
            if self._start and kept + fused.shape[1] <= self._buf.shape[1] and self._buf.shape[0] == fused.shape[0] \
                    and self._buf.is_contiguous():
                self._buf[:, :kept] = self._buf[:, self._start : self._len].clone()  # the window, to the front
            else:
                cap = ((kept + fused.shape[1]) // _BLOCK + 1) * _BLOCK  # >= one free slot: the next step never copies
                grown = fused.new_empty(fused.shape[0], cap, fused.shape[2])
                grown[:, :kept] = self._buf[:, self._start : self._len]
                self._buf = grown
            self._start, self._len = 0, kept
            need = kept + fused.shape[1]
        self._buf[:, self._len : need] = fused
        self._len = need

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' DeepSeek-V3 call: c_kv [B,1,Q,r], k_pe [B,1,Q,d_r] → views [B,1,S,r], [B,1,S,d_r]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.append(torch.cat([key_states[:, 0], value_states[:, 0]], dim=-1))
        fused = self.fused()
        return fused[:, None, :, : self.rank], fused[:, None, :, self.rank :]

    def fused(self) -> torch.Tensor:
        """The stored latent [B, S, r + d_r]."""
        return self._buf[:, self._start : self._len]

    def attended(self) -> torch.Tensor:
        """The latents the last `update`'s queries attend to [B, S, r + d_r]: every stored one here."""
        return self.fused()

    def stored_bytes(self) -> int:
        """Bytes of the stored tokens (what the cache holds per token × tokens)."""
        if self._buf is None:
            return 0
        return (self._len - self._start) * self._buf.shape[0] * self._buf.shape[2] * self._buf.element_size()

    def allocated_bytes(self) -> int:
        """Bytes allocated, block slack included."""
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()


class SlidingLatentLayer(LatentLayer, DynamicSlidingWindowLayer):
    """The latent cache of a sliding-window layer: after each call it keeps only the latents of the
    last `sliding_window - 1` tokens (all a later query can see), as transformers'
    `DynamicSlidingWindowLayer` keeps keys and values; its `get_mask_sizes` / `get_seq_length` (the
    window's bookkeeping, `cumulative_length`) are that class's. A call attends to the kept latents and
    its own new ones (`attended`), which is what `get_mask_sizes` announced to the mask.
    Between calls it holds at most `sliding_window - 1` tokens, in a buffer of at most that plus two
    blocks (a longer call's buffer is given back); the kept window moves to the buffer's front once a
    block of decode steps has filled it (an amortised copy of window / block latents per step)."""

    def __init__(self, sliding_window: int, **kwargs):
        self._attended: torch.Tensor | None = None  # what the last call attends to
        super().__init__(sliding_window=sliding_window, **kwargs)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q_len = key_states.shape[-2]
        self.cumulative_length += q_len
        self.append(torch.cat([key_states[:, 0], value_states[:, 0]], dim=-1))
        # the kept window and the new tokens: as many as the mask has columns (`get_mask_sizes`)
        self._attended = self._buf[:, max(self._start, self._len - (self.sliding_window - 1 + q_len)) : self._len]
        if not self.record_past:  # drop what no later query can see
            self._start = max(self._start, self._len - (self.sliding_window - 1))
            self._shrink()
        seen = self._attended
        return seen[:, None, :, : self.rank], seen[:, None, :, self.rank :]

    def _shrink(self) -> None:
        """Give back a buffer larger than the window needs (after a long prefill); `_attended` keeps
        viewing the old one until the next call."""
        target = ((self.sliding_window - 1 + _BLOCK) // _BLOCK + 1) * _BLOCK
        if self._buf.shape[1] > target:
            kept = self._len - self._start
            small = self._buf.new_empty(self._buf.shape[0], target, self._buf.shape[2])
            small[:, :kept] = self._buf[:, self._start : self._len]
            self._buf, self._start, self._len = small, 0, kept

    def attended(self) -> torch.Tensor:
        return self.fused() if self._attended is None else self._attended

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' sliding-window rules (`DynamicSlidingWindowLayer.crop`) on the latent buffer."""
        self._attended = None
        window = self.sliding_window
        if self.get_seq_length() >= window:
            if not self.record_past:
                raise RuntimeError("`crop` was called, but the current layer does not track past states, and the sliding "
                                   "window size was already reached. Call `activate_past_recording` before `crop`.")
            if tokens_to_remove > 0:
                raise RuntimeError("Once the sliding window size has been reached, a sliding layer can only be cropped "
                                   "by passing a negative int, to specify how many tokens to remove")
            n = -tokens_to_remove
            self._len -= n
            self.cumulative_length -= n
            self._start = max(self._start, self._len - (window - 1))
        else:
            DynamicLayer.crop(self, tokens_to_remove)
            self.cumulative_length = self._len - self._start


def latent_layer(cache: Cache, layer_idx: int) -> LatentLayer:
    """Make `cache.layers[layer_idx]` a LatentLayer (converting a filled plain DeepSeek-V3 layer), or a
    SlidingLatentLayer in place of an empty `DynamicSlidingWindowLayer` (a sliding-window layer)."""
    layers = cache.layers
    while len(layers) <= layer_idx:
        layers.append(LatentLayer())
    layer = layers[layer_idx]
    if isinstance(layer, LatentLayer):
        return layer
    if type(layer) is DynamicSlidingWindowLayer:
        if layer.is_initialized and layer.get_seq_length() > 0:
            raise AttnkitError("absorbed MLA attention cannot take over a filled sliding-window cache layer")
        layers[layer_idx] = SlidingLatentLayer(sliding_window=layer.sliding_window)
        return layers[layer_idx]
    if type(layer) is not DynamicLayer:
        raise AttnkitError(f"absorbed MLA attention needs a DynamicCache; got a {type(layer).__name__} layer")
    latent = LatentLayer()
    if layer.is_initialized and layer.get_seq_length() > 0:
        latent.update(layer.keys, layer.values)  # a cache filled by transformers' own DeepSeek-V3 path
    layers[layer_idx] = latent
    return latent


def split_kv_b(weight: torch.Tensor, heads: int, d_nope: int, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H·(d_nope + d_v), r] → W_UK [H, d_nope, r], W_UV [H, d_v, r] (views)."""
    w = weight.view(heads, d_nope + d_v, weight.shape[-1])
    return w[:, :d_nope], w[:, d_nope:]


def sdpa_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, device) -> tuple[torch.Tensor | None, bool]:
    """(attn_mask, is_causal) for SDPA from transformers' mask: [B|1, 1, Q, S] bool/additive, or None.

    None means "causal, no padding": query i sits at position kv_len - q_len + i.
    """
    if mask is not None:
        return mask[..., :kv_len], False
    if q_len == 1:
        return None, False
    if q_len == kv_len:
        return None, True
    return causal_mask(q_len, kv_len, device), False


def causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """Boolean [1, 1, Q, S] mask (True = attend) for the last Q of S positions."""
    pos = torch.arange(kv_len - q_len, kv_len, device=device)
    return (torch.arange(kv_len, device=device)[None, :] <= pos[:, None])[None, None]


def latent_attention(
    query: torch.Tensor, fused: torch.Tensor, rank: int, scaling: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """Softmax attention of latent-space queries against the fused latent cache (MQA with one shared head).

    query [B, H, Q, r + d_r] (= [q_nope·W_UK | q_pe]), fused [B, S, r + d_r] → output [B, H, Q, r] (latent).
    Keys and values are the same tensor: the output's k_pe columns are computed and dropped, which keeps
    q/k/v head dims equal so SDPA takes its fused (flash) kernel and never materialises [Q, S] scores.
    For few query rows the H heads fold into rows of one head, so the cache is streamed once per call.
    """
    b, h, q_len, width = query.shape
    kv_len = fused.shape[1]
    kv = fused[:, None]  # [B, 1, S, r + d_r]
    attn_mask, causal = sdpa_mask(mask, q_len, kv_len, query.device)
    if q_len <= FOLD_MAX_QUERY:
        folded = query.reshape(b, 1, h * q_len, width)  # rows ordered (head, query)
        if causal:
            attn_mask = causal_mask(q_len, kv_len, query.device)
        if attn_mask is not None:  # [B|1, 1, Q, S] → [B|1, 1, H·Q, S]
            attn_mask = attn_mask[:, :, None].expand(-1, -1, h, -1, -1).reshape(attn_mask.shape[0], 1, h * q_len, -1)
        out = F.scaled_dot_product_attention(folded, kv, kv, attn_mask=attn_mask, scale=scaling)
        return out.view(b, h, q_len, width)[..., :rank]
    out = F.scaled_dot_product_attention(query, kv, kv, attn_mask=attn_mask, is_causal=causal, scale=scaling,
                                         enable_gqa=True)
    return out[..., :rank]


def absorbed_cost(q_len: int, kv_len: int, heads: int, rank: int, rope: int, d_nope: int, d_v: int) -> float:
    """Multiply-adds of one absorbed call: absorb the query, scores + values over the latent, un-absorb
    (the attention term weighted by the measured kernel factor when heads are not folded)."""
    factor = 1.0 if q_len <= FOLD_MAX_QUERY else ABSORBED_KERNEL_FACTOR
    return q_len * heads * rank * (d_nope + d_v) + factor * 2 * q_len * kv_len * heads * (rank + rope)


def expanded_cost(q_len: int, kv_len: int, heads: int, rank: int, rope: int, d_nope: int, d_v: int) -> int:
    """Multiply-adds of one expanded call: kv_b_proj over the whole cache, then attention (V padded)."""
    return kv_len * rank * heads * (d_nope + d_v) + q_len * kv_len * heads * (d_nope + rope + max(d_nope + rope, d_v))


@dataclass(frozen=True)
class LatentDims:
    """The sizes the absorbed and expanded paths need: heads, latent r, shared RoPE key d_r, d_nope, d_v."""

    heads: int
    rank: int
    rope: int
    d_nope: int
    d_v: int


def use_absorbed(mode: str, q_len: int, kv_len: int, dims: LatentDims) -> bool:
    """The per-call rule: in `auto`, the path with fewer multiply-adds (see benchmarks/prefill_rule.py)."""
    if mode != "auto":
        return mode == "absorbed"
    shape = (dims.heads, dims.rank, dims.rope, dims.d_nope, dims.d_v)
    return absorbed_cost(q_len, kv_len, *shape) <= expanded_cost(q_len, kv_len, *shape)


def absorbed_output(q_nope, q_rot, fused, kv_b: torch.Tensor, dims: LatentDims, scaling: float, mask) -> torch.Tensor:
    """Attention in latent space: q_nope [B, H, Q, d_nope] absorbed through W_UK, the output through W_UV
    (kv_b [H·(d_nope + d_v), r]); fused [B, S, r + d_r] → [B, Q, H, d_v]."""
    w_uk, w_uv = split_kv_b(kv_b, dims.heads, dims.d_nope, dims.d_v)
    q_latent = torch.einsum("bhqn,hnr->bhqr", q_nope, w_uk)  # [B, H, Q, r]
    query = torch.cat([q_latent, q_rot], dim=-1)  # [B, H, Q, r + d_r]
    out_latent = latent_attention(query, fused, dims.rank, scaling, mask)  # [B, H, Q, r]
    return torch.einsum("bhqr,hvr->bqhv", out_latent, w_uv)  # [B, Q, H, d_v]


def expanded_output(q_nope, q_rot, fused, kv_b_proj: nn.Module, dims: LatentDims, scaling: float, mask) -> torch.Tensor:
    """transformers' math (kv_b_proj over the cache), with V zero-padded to the q/k head dim so SDPA
    uses its fused kernel on CPU instead of materialising the [Q, S] scores. → [B, Q, H, d_v]"""
    b, h, q_len, _ = q_nope.shape
    kv_len = fused.shape[1]
    # [B, S, r] → [B, S, H, d_nope + d_v] → [B, H, S, d_nope + d_v]
    kv = kv_b_proj(fused[..., : dims.rank]).view(b, kv_len, h, -1).transpose(1, 2)
    k_nope, value = torch.split(kv, [dims.d_nope, dims.d_v], dim=-1)
    k_pe = fused[:, None, :, dims.rank :].expand(b, h, kv_len, -1)
    key = torch.cat([k_nope, k_pe], dim=-1)  # [B, H, S, d_nope + d_r]
    query = torch.cat([q_nope, q_rot], dim=-1)
    pad = dims.d_nope + dims.rope - dims.d_v
    if pad > 0:
        value = F.pad(value, (0, pad))
    elif pad < 0:
        query, key = F.pad(query, (0, -pad)), F.pad(key, (0, -pad))
    attn_mask, causal = sdpa_mask(mask, q_len, kv_len, q_nope.device)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=causal, scale=scaling)
    return out[..., : dims.d_v].transpose(1, 2)  # [B, Q, H, d_v]


def latent_output(module: nn.Module, q_nope, q_rot, fused, mask) -> torch.Tensor:
    """The attention output [B, Q, H, d_v] of a latent-attention module (`attnkit_mode`, `latent_dims`,
    `kv_b_proj`, `scaling`) by the path the per-call rule picks."""
    dims = module.latent_dims
    if use_absorbed(module.attnkit_mode, q_nope.shape[2], fused.shape[1], dims):
        return absorbed_output(q_nope, q_rot, fused, module.kv_b_proj.weight, dims, module.scaling, mask)
    return expanded_output(q_nope, q_rot, fused, module.kv_b_proj, dims, module.scaling, mask)


def cached_latent(cache: Cache | None, layer_idx: int, c_kv: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
    """Append c_kv [B, 1, Q, r] and k_rot [B, 1, Q, d_r] to the layer's latent cache; the fused latent
    of every token the new ones attend to [B, S, r + d_r] (every stored one; a sliding layer's window
    and the new ones; the new ones alone without a cache)."""
    if cache is None:
        return torch.cat([c_kv[:, 0], k_rot[:, 0]], dim=-1)
    layer = latent_layer(cache, layer_idx)
    cache.update(c_kv, k_rot, layer_idx)
    return layer.attended()


class AbsorbedDeepseekV3Attention(ds.DeepseekV3Attention):
    """DeepseekV3Attention with absorbed and SDPA-expanded paths; `attnkit_mode` picks per call (MODES)."""

    attnkit_mode = "auto"
    attnkit_latent = True

    @property
    def latent_dims(self) -> LatentDims:
        return LatentDims(self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim)

    def use_absorbed(self, q_len: int, kv_len: int) -> bool:
        return use_absorbed(self.attnkit_mode, q_len, kv_len, self.latent_dims)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        if "past_key_values" in kwargs and cache is None:
            cache = kwargs.pop("past_key_values")
        if self.training and self.attention_dropout > 0:  # attention dropout: transformers' own path
            return super().forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        b, q_len = hidden_states.shape[:-1]
        if self.q_lora_rank is None:
            q_states = self.q_proj(hidden_states)
        else:
            q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        # [B, Q, H·(d_nope + d_r)] → [B, H, Q, d_nope + d_r]
        q_states = q_states.view(b, q_len, -1, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        kv_nope, k_rot = torch.split(
            self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        kv_nope = self.kv_a_layernorm(kv_nope).view(b, 1, q_len, self.kv_lora_rank)
        k_rot = k_rot.view(b, 1, q_len, self.qk_rope_head_dim)
        cos, sin = position_embeddings
        rope = ds.apply_rotary_pos_emb_interleave if self.config.rope_interleave else ds.apply_rotary_pos_emb
        q_rot, k_rot = rope(q_rot, k_rot, cos, sin)
        fused = cached_latent(cache, self.layer_idx, kv_nope, k_rot)  # [B, S, r + d_r]
        out = latent_output(self, q_nope, q_rot, fused, attention_mask)
        return self.o_proj(out.reshape(b, q_len, -1)), None  # out [B, Q, H, d_v]


def is_mla(model: nn.Module) -> bool:
    """Whether the model runs MLA attention: DeepSeek-V3 modules or attnkit-format latent attention."""
    return any(isinstance(m, ds.DeepseekV3Attention) or getattr(m, "attnkit_latent", False) for m in model.modules())


def enable_absorbed(model: nn.Module, mode: str = "auto") -> nn.Module:
    """Switch every DeepSeek-V3 attention of `model` to the absorbed implementation (in place).

    mode: "auto" (per call, the path with fewer multiply-adds: absorbed for decode), "absorbed", "expanded"
    (transformers' math with an SDPA-friendly layout, on the latent cache). Returns the model. Raises AttnkitError for a non-MLA model.
    """
    if mode not in MODES:
        raise AttnkitError(f"unknown MLA attention mode {mode!r}; choose one of {', '.join(MODES)}")
    found = 0
    for module in model.modules():
        if isinstance(module, ds.DeepseekV3Attention):
            module.__class__ = AbsorbedDeepseekV3Attention
        if getattr(module, "attnkit_latent", False):  # attnkit-format modules decode absorbed natively
            module.attnkit_mode = mode
            found += 1
    if not found:
        raise AttnkitError("absorbed attention needs an MLA (DeepSeek-V3 format) model; this one has no MLA layers")
    return model


def disable_absorbed(model: nn.Module) -> nn.Module:
    """Restore transformers' own DeepseekV3Attention class on every absorbed module."""
    for module in model.modules():
        if isinstance(module, AbsorbedDeepseekV3Attention):
            module.__class__ = ds.DeepseekV3Attention
    return model
