"""Titans retrofit (Behrouz, Zhong & Mirrokni 2025, "Learning to Memorize at Test Time"), Memory as Gate.

Per layer, beside the source attention restricted to the last W tokens, a neural long-term memory:
a per-head MLP M whose weights are per-sequence state, written while reading. For token t (per head,
memory keys/queries L2-normalised):

    loss    l_t(M) = ||M(k_t) - v_t||^2                        (associative memory)
    S_t     = eta_t * S_{t-1} - theta_t * clip(grad l_t(M_0))   (surprise with momentum; clip: norm <= 1)
    M_t     = (1 - alpha_t) * M_{t-1} + S_t                     (forgetting = weight decay)

eta (momentum), alpha (forgetting) and theta (step) are per-token, per-head sigmoids of linear maps
of the layer input; theta is scaled by 1/C, so the steps of one chunk (all taken at the same weights)
sum to at most 1, the stable step of gradient descent on ||W k - v||^2 with unit keys (measured here:
unscaled, a random model's memory overflowed within four chunks of 8). Tokens are read in chunks of C: every gradient in a chunk is taken at M_0, the
weights at the chunk's start (the paper's parallel form), so one chunk's update is a closed form,
a few matmuls with per-token scalar coefficients (`chunk_coefficients`), with no [C, M, M] tensor.
A token retrieves M_0(q_t): the memory of the earlier chunks; its own chunk is inside the window
(C <= W is required).

Memory as Gate: out_h = attn_h + ramp * g_h(x) * (mem_h - attn_h), mem_h = M_0(q_t) mapped to the head's
value space. `ramp` starts at 0 (the converted model is the source with a window) and is opened by
the fine-tune schedule like DEX/DIFF's lambda (`attnkit_set_step`).

State kept while generating (`TitansCacheLayer`, a transformers `DynamicSlidingWindowLayer`): the
last W - 1 keys/values, the memory weights and momentum at the last chunk boundary, and C slots for
the tokens read since (their memory keys, values and gate values). Its size does not grow past W.

This file is copied next to converted checkpoints (trust_remote_code): it imports only torch and transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicSlidingWindowLayer

from .dex import anneal_ramp

# gate biases at conversion: momentum eta ~ 0.88, forgetting alpha ~ 0.007, step theta ~ 0.12 / C,
# MAG gate g ~ 0.12 once the ramp is open (the memory starts as a small correction)
ETA_BIAS, ALPHA_BIAS, THETA_BIAS, MIX_BIAS = 2.0, -5.0, -2.0, -2.0
# a token's surprise (its gradient of one weight matrix) is scaled to Frobenius norm <= this, so the
# state stays bounded: |M| <= (C * theta_max / (1 - eta)) / alpha. Measured: without it the reference's
# depth-2 memory overflowed to NaN within 7 chunks of 16 tokens (weights x10 per chunk from the 3rd on).
SURPRISE_CLIP = 1.0
PENDING = ("k", "v", "log_keep", "log_eta", "theta")  # what a token waiting for its chunk's end keeps


# ---------------------------------------------------------------- the memory MLP (pure functions)


def _silu_grad(z: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def memory_apply(weights: list[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x [B, H, N, M] through the MLP with per-sequence weights [B, H, M_in, M_out] (SiLU between
    layers); returns the output and each layer's pre-activation input (for `memory_grads`)."""
    pre = []
    h = x
    for i, w in enumerate(weights):
        pre.append(h)
        h = (F.silu(h) if i > 0 else h) @ w  # [B, H, N, M_out]
    return h, pre


def memory_grads(weights: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                 coefs: list[torch.Tensor]) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """For each coefficient set c [B, H, N]: sum_t c_t * clip(grad_W l_t(W)) per weight, l_t = ||M(k_t) - v_t||^2,
    each token's gradient of each weight scaled to Frobenius norm <= 1 (`SURPRISE_CLIP`); and l_t [B, H, N]
    itself, each token's surprise (what the sparse slots keep the most of).

    Written out (not autograd) so the per-token gradients are never materialised: a token's gradient
    of a weight is the outer product a_t^T d_t (a_t: the layer's input, d_t: the loss gradient at its
    output), its norm |a_t| |d_t|, and sum_t c_t a_t^T d_t is one matmul."""
    y, pre = memory_apply(weights, k)
    delta = 2 * (y - v)  # dl/dy [B, H, N, M]
    loss = (y - v).square().sum(-1)  # [B, H, N]
    sums: list[list[torch.Tensor]] = [[None] * len(weights) for _ in coefs]
    for i in reversed(range(len(weights))):
        a = F.silu(pre[i]) if i > 0 else pre[i]  # the layer's input [B, H, N, M_in]
        norm = a.norm(dim=-1) * delta.norm(dim=-1)  # [B, H, N]: |a_t^T d_t|_F
        clip = (SURPRISE_CLIP / norm.clamp_min(1e-30)).clamp(max=1.0)
        for j, c in enumerate(coefs):
            sums[j][i] = (a * (c * clip).unsqueeze(-1)).transpose(-1, -2) @ delta  # [B, H, M_in, M_out]
        if i > 0:
            delta = (delta @ weights[i].transpose(-1, -2)) * _silu_grad(pre[i])
    return sums, loss


def chunk_coefficients(log_keep: torch.Tensor, log_eta: torch.Tensor, theta: torch.Tensor) -> dict[str, torch.Tensor]:
    """Scalars that fold one chunk of the recurrence into closed form; inputs [B, H, C] (fp32).

    With A = prod(1 - alpha), E = prod(eta) over a range of steps, g_s the gradient at M_0:
        M_C = A_all M_0 + carry S_0 - sum_s w_s g_s,   w_s = theta_s sum_{t>=s} A_(t,C] E_(s,t]
        S_C = E_all S_0 - sum_s u_s g_s,               u_s = theta_s E_(s,C],  carry = sum_t A_(t,C] E_[1,t]
    """
    la, le = log_keep.cumsum(-1), log_eta.cumsum(-1)  # [B, H, C]
    after = la[..., -1:] - la  # log A_(t, C]
    n = log_keep.shape[-1]
    later = torch.ones(n, n, dtype=torch.bool, device=la.device).tril()  # [t, s]: t >= s
    expo = (after + le).unsqueeze(-1) - le.unsqueeze(-2)  # [B, H, t, s]: log A_(t,C] E_(s,t]
    w = theta * expo.masked_fill(~later, float("-inf")).exp().sum(-2)
    return {"keep_all": la[..., -1].exp(), "eta_all": le[..., -1].exp(), "carry": (after + le).exp().sum(-1),
            "w": w, "u": theta * (le[..., -1:] - le).exp()}


@dataclass
class MemoryState:
    """One layer's memory for a batch: MLP weights and momentum at the last chunk boundary, and the
    tokens read since (each PENDING field [B, H, n, ...], n < chunk)."""

    weights: list[torch.Tensor]
    momentum: list[torch.Tensor]
    pending: dict[str, torch.Tensor] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.weights, *self.momentum, *self.pending.values()]

    def map(self, fn) -> MemoryState:
        return MemoryState([fn(w) for w in self.weights], [fn(s) for s in self.momentum],
                           {k: fn(t) for k, t in self.pending.items()})


def update_chunk(state: MemoryState, chunk: dict[str, torch.Tensor],
                 co: dict[str, torch.Tensor]) -> tuple[MemoryState, torch.Tensor]:
    """The memory after one full chunk of tokens (fields of PENDING, [B, H, C, ...]) whose
    `chunk_coefficients` are `co`, and each token's surprise [B, H, C] (-inf for padding: it writes nothing)."""
    (gw, gu), loss = memory_grads(state.weights, chunk["k"], chunk["v"], [co["w"], co["u"]])
    scalar = lambda name: co[name][..., None, None]  # [B, H] -> [B, H, 1, 1]
    weights = [scalar("keep_all") * w + scalar("carry") * s - g for w, s, g in zip(state.weights, state.momentum, gw)]
    momentum = [scalar("eta_all") * s - g for s, g in zip(state.momentum, gu)]
    return MemoryState(weights, momentum), loss.masked_fill(chunk["theta"] == 0, float("-inf"))


def memory_read_write(state: MemoryState, queries: torch.Tensor | None, tokens: dict[str, torch.Tensor],
                      chunk: int) -> tuple[torch.Tensor | None, MemoryState, torch.Tensor]:
    """Read `queries` [B, H, T, M] and write `tokens` (PENDING fields, [B, H, T, ...]) chunk by chunk;
    also returns the surprise [B, H, n] of the n tokens written, in order from the first pending one.
    `queries` None: write only (nothing would use the reads), the reads returned are None.

    Chunk boundaries count from the first token the state ever saw, so reading a sequence in pieces
    (decoding) gives what reading it at once gives. Each query reads the weights at its chunk's start.
    Only the weight updates run chunk after chunk (each chunk's gradients are taken at the weights
    the previous one left); the coefficients of every chunk and all the reads are batched."""
    todo = {k: torch.cat([state.pending[k], t], dim=2) if state.pending else t for k, t in tokens.items()}
    total = todo["k"].shape[2]
    offset = total - tokens["k"].shape[2]  # pending tokens before the first new one
    full = total // chunk  # complete chunks, written now; the rest waits
    starts, surprise = [state.weights], []  # the weights each chunk reads
    if full:
        chunks = {k: t[:, :, :full * chunk].unflatten(2, (full, chunk)) for k, t in todo.items()}  # [B, H, n, C, ...]
        co = chunk_coefficients(chunks["log_keep"], chunks["log_eta"], chunks["theta"])  # each [B, H, n(, C)]
        for c in range(full):
            state, loss = update_chunk(state, {k: t[:, :, c] for k, t in chunks.items()}, {k: t[:, :, c] for k, t in co.items()})
            starts.append(state.weights)
            surprise.append(loss)
    state = MemoryState(state.weights, state.momentum,
                        {k: t[:, :, full * chunk:] for k, t in todo.items()} if total > full * chunk else {})
    written = torch.cat(surprise, dim=2) if surprise else todo["k"].new_zeros(*todo["k"].shape[:2], 0)
    if queries is None:
        return None, state, written
    first, last = offset // chunk, (total - 1) // chunk  # the chunks the queries fall in
    weights = [torch.stack([s[i] for s in starts[first:last + 1]], dim=2) for i in range(len(state.weights))]
    lead = offset - first * chunk  # query slots before the first query in its chunk
    padded = F.pad(queries, (0, 0, lead, (last + 1) * chunk - total))  # [B, H, (n_read)·C, M]
    reads = memory_apply(weights, padded.unflatten(2, (last + 1 - first, chunk)))[0]  # [B, H, n_read, C, M]
    return reads.flatten(2, 3)[:, :, lead:lead + queries.shape[2]], state, written


# ---------------------------------------------------------------- masks for the window


def new_token_validity(mask: torch.Tensor | None, q_len: int, k_len: int) -> torch.Tensor | None:
    """[B, T] True for real tokens, read off the diagonal of the 4D attention mask (a padding token
    attends to nothing, not even itself); None when there is no mask (no padding)."""
    if mask is None:
        return None
    idx = torch.arange(q_len, device=mask.device)
    diag = mask[:, 0, idx, k_len - q_len + idx]  # [B, T]
    return diag if diag.dtype == torch.bool else diag > torch.finfo(diag.dtype).min / 2


def window_mask(mask: torch.Tensor | None, q_len: int, k_len: int, window: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """The model's mask [B, 1, T, S] further restricted to the last `window` keys (the query's own
    included); query i is key k_len - q_len + i. No mask in: causal + window, additive in `dtype`."""
    qi = torch.arange(q_len, device=device).unsqueeze(1) + (k_len - q_len)  # [T, 1]
    kj = torch.arange(k_len, device=device).unsqueeze(0)  # [1, S]
    band = (kj <= qi) & (qi - kj < window)  # [T, S]
    if mask is None:
        return torch.zeros(q_len, k_len, dtype=dtype, device=device).masked_fill(~band, torch.finfo(dtype).min)[None, None]
    mask = mask[..., :k_len]
    return mask & band if mask.dtype == torch.bool else mask.masked_fill(~band, torch.finfo(mask.dtype).min)


# ---------------------------------------------------------------- the per-layer module


class TitansMemory(nn.Module):
    """One layer's long-term memory and its Memory-as-Gate mix with the windowed attention output."""

    def __init__(self, hidden: int, heads: int, value_dim: int, memory_dim: int, depth: int, window: int,
                 chunk: int, layer_idx: int, anneal_fraction: float = 0.25, slots: int = 0, slot_bias: float = 0.0,
                 mix: bool = True):
        super().__init__()
        self.heads, self.memory_dim, self.window, self.chunk = heads, memory_dim, window, chunk
        self.slots = slots  # per KV head: exact keys/values of the most surprising tokens the window lost
        self.slot_bias = slot_bias  # added to the slots' attention logits
        self.mix_memory = mix  # False: the gate stays shut, the memory only chooses the slots
        self.register_buffer("ramp", torch.zeros(1))
        self.register_buffer("anneal_fraction", torch.tensor([float(anneal_fraction)]))
        self.initial = nn.ParameterList()
        if depth == 0:  # the window alone: the baseline a memory is measured against
            return
        gen = torch.Generator().manual_seed(2000 + layer_idx)
        normal = lambda *shape, std: torch.randn(*shape, generator=gen) * std
        self.q_proj = nn.Linear(hidden, heads * memory_dim, bias=False)
        self.k_proj = nn.Linear(hidden, heads * memory_dim, bias=False)
        self.v_proj = nn.Linear(hidden, heads * memory_dim, bias=False)
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            proj.weight.data.copy_(normal(heads * memory_dim, hidden, std=hidden ** -0.5))
        self.gates = nn.Linear(hidden, 3 * heads)  # eta, alpha, theta per head
        self.gates.weight.data.copy_(normal(3 * heads, hidden, std=0.02))
        self.gates.bias.data.copy_(torch.tensor([ETA_BIAS, ALPHA_BIAS, THETA_BIAS]).repeat_interleave(heads))
        self.mix = nn.Linear(hidden, heads)  # the MAG gate g_h(x)
        nn.init.zeros_(self.mix.weight)
        nn.init.constant_(self.mix.bias, MIX_BIAS)
        # the memory's weights before any token (learned), per head [H, M_in, M_out]
        self.initial.extend(nn.Parameter(normal(heads, memory_dim, memory_dim, std=memory_dim ** -0.5))
                            for _ in range(depth))
        eye = torch.eye(memory_dim, value_dim) if memory_dim == value_dim else normal(memory_dim, value_dim, std=memory_dim ** -0.5)
        self.out = nn.Parameter(eye.expand(heads, -1, -1).clone())  # memory -> head value space [H, M, d_v]

    def attnkit_set_step(self, step: int, total_steps: int) -> None:
        if self.mix_memory:
            self.ramp.fill_(anneal_ramp(step, total_steps, float(self.anneal_fraction)))

    def initial_state(self, batch: int) -> MemoryState:
        weights = [w.float().unsqueeze(0).expand(batch, -1, -1, -1) for w in self.initial]
        return MemoryState(weights, [torch.zeros_like(w) for w in weights])

    def _heads(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return proj(x).view(*x.shape[:-1], self.heads, self.memory_dim).transpose(1, 2).float()  # [B, T, H·M] -> [B, H, T, M]

    def tokens(self, x: torch.Tensor, valid: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """What each token writes (PENDING fields, [B, H, T, ...], fp32); padding writes nothing."""
        z = self.gates(x).float().transpose(1, 2).view(x.shape[0], 3, self.heads, x.shape[1])  # [B, 3, H, T]
        out = {"k": F.normalize(self._heads(self.k_proj, x), dim=-1), "v": self._heads(self.v_proj, x),
               "log_eta": F.logsigmoid(z[:, 0]), "log_keep": F.logsigmoid(-z[:, 1]),
               "theta": torch.sigmoid(z[:, 2]) / self.chunk}
        if valid is not None:  # padding: eta = 1, alpha = 0, theta = 0 -> the state passes through
            keep = valid[:, None, :].to(z.device)  # [B, 1, T]
            for name in ("log_eta", "log_keep", "theta"):
                out[name] = out[name] * keep
        return out

    def read_write(self, x: torch.Tensor, valid: torch.Tensor | None, state: MemoryState | None,
                   keep: bool = True) -> tuple[torch.Tensor | None, MemoryState | None, torch.Tensor | None]:
        """x [B, T, D] (the attention's input) -> (the memory's reads [B, H, T, M], the new state, the surprise
        [B, H, n] of the n tokens written, from the first that was pending).

        With the ramp at 0 the output is the attention's whatever the memory holds, so at inference (no
        grad) nothing is read (reads None, and `blend` passes the attention through); with no state
        kept either (`keep` False: no cache) and no slots to choose, nothing is written: (None, None,
        None). In training it is all computed: a first step at ramp 0 that trains only the memory needs
        the (zero) gradient path."""
        unread = not bool(self.ramp) and not torch.is_grad_enabled()
        if not len(self.initial) or (unread and not keep and not self.slots):  # depth 0, or nothing to do
            return None, None, None
        if state is None:
            state = self.initial_state(x.shape[0])
        q = None if unread else F.normalize(self._heads(self.q_proj, x), dim=-1)
        return memory_read_write(state, q, self.tokens(x, valid), self.chunk)

    def blend(self, x: torch.Tensor, attn_out: torch.Tensor, read: torch.Tensor | None) -> torch.Tensor:
        """Memory as Gate: attn_out [B, T, H, d_v] moved towards the memory's reads by the gate g_h(x) * ramp."""
        if read is None:
            return attn_out
        mem = (read @ self.out.float()).transpose(1, 2).to(attn_out.dtype)  # [B, H, T, d_v] -> [B, T, H, d_v]
        gate = (self.ramp * torch.sigmoid(self.mix(x).float())).to(attn_out.dtype).unsqueeze(-1)  # [B, T, H, 1]
        # a closed gate gives the attention output itself, whatever the memory holds
        return torch.where(gate == 0, attn_out, attn_out + gate * (mem - attn_out))

    def forward(self, x: torch.Tensor, attn_out: torch.Tensor, valid: torch.Tensor | None,
                state: MemoryState | None, keep: bool = True) -> tuple[torch.Tensor, MemoryState | None]:
        """x [B, T, D], attn_out [B, T, H, d_v] -> (mixed output, new state): `read_write`, then `blend`."""
        read, state, _ = self.read_write(x, valid, state, keep)
        return self.blend(x, attn_out, read), state

    def extra_repr(self) -> str:
        return f"heads={self.heads}, memory_dim={self.memory_dim}, depth={len(self.initial)}, window={self.window}, chunk={self.chunk}"


# ---------------------------------------------------------------- sparse slots: what the window lost, kept exactly


@dataclass
class Slots:
    """One layer's kept tokens per KV head (S at most): keys [B, G, S, d_k], values [B, G, S, d_v],
    positions and surprise [B, G, S] (-inf: an empty slot)."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    score: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.pos, self.score]

    def map(self, fn) -> Slots:
        return Slots(*(fn(t) for t in self.tensors()))


def empty_slots(k: torch.Tensor, v: torch.Tensor, slots: int) -> Slots:
    """`slots` empty slots (surprise -inf) shaped like k [B, G, ·, d_k] and v: a cache holds its S slots from
    the first token on, so they add nothing per token (only the window's surprises do)."""
    B, G = k.shape[:2]
    return Slots(k.new_zeros(B, G, slots, k.shape[-1]), v.new_zeros(B, G, slots, v.shape[-1]),
                 torch.full((B, G, slots), -1, dtype=torch.long, device=k.device),
                 torch.full((B, G, slots), float("-inf"), device=k.device))


def kv_surprise(loss: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Per KV head, the mean surprise of the query heads it serves: [B, H, n] -> [B, G, n]."""
    B, H, n = loss.shape
    return loss.view(B, kv_heads, H // kv_heads, n).mean(2)


def slot_mask(q_pos: torch.Tensor, pos: torch.Tensor, score: torch.Tensor, window: int, slots: int) -> torch.Tensor:
    """[B, G, T, N]: key j is a slot of query i when it has left i's window (pos_j <= pos_i - W), has a
    surprise (NaN: not known yet; -inf: padding) and fewer than `slots` other tokens that have left it
    rank above it (a higher surprise; on a tie, the later token). q_pos [T]; pos, score [B, G, N].

    The keys kept are then the S most surprising of all the window has lost: with scores fixed once
    known, a token evicted from the S best never returns, so a store of S slots per KV head, updated as
    tokens leave the window (`next_slots`), is all a decoder needs to give what this gives at once."""
    gone = pos.unsqueeze(-2) <= (q_pos - window)[:, None]  # [B, G, T, N]
    s_j, s_k = score.unsqueeze(-1), score.unsqueeze(-2)  # [B, G, N, 1], [B, G, 1, N]
    above = (s_k > s_j) | ((s_k == s_j) & (pos.unsqueeze(-2) > pos.unsqueeze(-1)))  # [B, G, j, k]: k above j
    rank = gone.float() @ above.transpose(-1, -2).float()  # [B, G, T, j]: gone for i and above j (exact counts)
    return gone & (rank < slots) & torch.isfinite(score).unsqueeze(-2)


def next_slots(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, score: torch.Tensor, chosen: torch.Tensor,
               slots: int) -> Slots:
    """The store the next query reads: its slots `chosen` [B, G, N] (its row of `slot_mask`, N >= S) among
    candidates k [B, G, N, d_k], v, pos, score [B, G, N] (the old store and every key of this step)."""
    idx = chosen.float().topk(slots, dim=-1).indices  # [B, G, S], the chosen first
    take = lambda t: t.gather(2, idx[..., None].expand(*idx.shape, t.shape[-1]))
    empty = ~chosen.gather(-1, idx)
    return Slots(take(k), take(v), pos.gather(-1, idx), score.gather(-1, idx).masked_fill(empty, float("-inf")))


def key_scores(stored: torch.Tensor | None, k: torch.Tensor, new: int, pending: int,
               surprise: torch.Tensor | None) -> torch.Tensor:
    """The surprise of every key of this step [B, G, N] (the window kept in the cache, then `new` tokens):
    the cache's scores (`stored`), NaN for the new tokens, then the `surprise` [B, G, n] of the tokens the
    memory wrote now, from the first of the `pending` ones it had waiting (all within the window: C <= W)."""
    B, G, N = k.shape[:3]
    nan = torch.full((B, G, new), float("nan"), device=k.device)
    scores = nan if stored is None or stored.shape[-1] == 0 else torch.cat([stored, nan], dim=-1)
    if surprise is not None and surprise.shape[-1]:
        first = N - new - pending
        scores[..., first:first + surprise.shape[-1]] = surprise
    return scores


def admit(store: Slots, k: torch.Tensor, v: torch.Tensor, pos: int, score: torch.Tensor) -> Slots:
    """`store` once the key k [B, G, d_k] (value v [B, G, d_v], position `pos`, surprise `score` [B, G]) has
    left the window: it takes the place of the lowest-ranked slot (the least surprise; on a tie, the
    earliest) when it ranks above it. It is later than every slot, so a tie is enough; an unknown or
    padding surprise (NaN, -inf) is never kept. The same choice as `slot_mask`'s, in O(S)."""
    low = store.score.min(-1, keepdim=True).values  # [B, G, 1]
    latest = torch.iinfo(store.pos.dtype).max
    worst = torch.where(store.score == low, store.pos, latest).argmin(-1, keepdim=True)  # [B, G, 1]
    take = (torch.isfinite(score) & (score >= low[..., 0])).unsqueeze(-1)  # [B, G, 1]
    put = lambda t, new: torch.where(take.unsqueeze(-1), t.scatter(2, worst[..., None].expand(*worst.shape, t.shape[-1]), new[:, :, None]), t)
    return Slots(put(store.k, k), put(store.v, v),
                 torch.where(take, store.pos.scatter(2, worst, torch.full_like(worst, pos)), store.pos),
                 torch.where(take, store.score.scatter(2, worst, score[..., None]), store.score))


def _slots_attention_mask(titans: TitansMemory, mask: torch.Tensor, kept: torch.Tensor, allowed: torch.Tensor,
                          heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Each query's mask [B, H, T, S + N] over the slots and the window's keys, in the kind of `mask` (bool or
    additive; additive whenever `slot_bias` shifts the slots' logits), from `kept` (the slot columns it
    reads) and `allowed` (every column it may see), both [B, G, T, S + N]."""
    G = kept.shape[1]
    if mask.dtype == torch.bool and not titans.slot_bias:
        return allowed.repeat_interleave(heads // G, dim=1)
    dtype = mask.dtype if mask.dtype != torch.bool else dtype
    # a slot's logit shifted by slot_bias (0 on the window's keys), then the keys a query may not see
    additive = (titans.slot_bias * kept.to(dtype)).masked_fill(~allowed, torch.finfo(dtype).min)
    return additive.repeat_interleave(heads // G, dim=1)


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def _with_slots(titans: TitansMemory, layer: TitansCacheLayer | None, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor, heads: int, seq: int, pending: int, surprise: torch.Tensor | None):
    """(k, v with the layer's slots in front, each query's mask over them [B, H, T, S + N]); stores the
    next query's slots and the window's scores in the cache."""
    B, G, N = k.shape[:3]
    surprise = None if surprise is None else kv_surprise(surprise, G)
    if layer is not None and layer.slots is not None and seq == 1 and N <= titans.window:
        return _decode_slots(titans, layer, k, v, mask, heads, pending, surprise)
    end = layer.cumulative_length if layer is not None else seq  # tokens seen, this step's included
    scores = key_scores(layer.scores if layer is not None else None, k, seq, pending, surprise)
    store = layer.slots if layer is not None and layer.slots is not None else empty_slots(k, v, titans.slots * (layer is not None))
    pos = torch.cat([store.pos, torch.arange(end - N, end, device=k.device).expand(B, G, N)], dim=-1)
    score = torch.cat([store.score, scores], dim=-1)
    window = _allowed(mask)  # [B or 1, 1, T, N]
    allowed = torch.cat([window.new_zeros(B, G, seq, store.pos.shape[-1]), window.expand(B, G, seq, N)], dim=-1)
    # one more query row with a cache: the next token's slots, what the cache keeps (one ranking for both)
    queries = torch.arange(end - seq, end + (layer is not None), device=k.device)
    kept = slot_mask(queries, pos, score, titans.window, titans.slots)  # [B, G, T (+1), S + N]
    allowed = allowed | kept[:, :, :seq]
    k_all, v_all = torch.cat([store.k, k], dim=2), torch.cat([store.v, v], dim=2)
    if layer is not None:
        layer.slots = next_slots(k_all, v_all, pos, score, kept[:, :, seq], titans.slots)
        layer.scores = scores[..., N - layer.keys.shape[-2]:]  # aligned with the window the cache keeps
    return k_all, v_all, _slots_attention_mask(titans, mask, kept[:, :, :seq], allowed, heads, k.dtype)


def _decode_slots(titans: TitansMemory, layer: TitansCacheLayer, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor, heads: int, pending: int, surprise: torch.Tensor | None):
    """`_with_slots` for one new token after the first step (decoding): the query reads the store as it is
    (chosen for it at the last step: none of the window's N <= W keys has left its window), and at most
    the window's oldest key leaves the next query's, to be `admit`ted."""
    B, G, N = k.shape[:3]
    store = layer.slots
    scores = key_scores(layer.scores, k, 1, pending, surprise)  # [B, G, N]
    filled = torch.isfinite(store.score)[:, :, None]  # [B, G, 1, S]
    kept = torch.cat([filled, filled.new_zeros(B, G, 1, N)], dim=-1)  # [B, G, 1, S + N]
    allowed = torch.cat([filled, _allowed(mask).expand(B, G, 1, N)], dim=-1)
    k_all, v_all = torch.cat([store.k, k], dim=2), torch.cat([store.v, v], dim=2)
    if N == titans.window:  # the next query's window starts one key later
        layer.slots = admit(store, k[:, :, 0], v[:, :, 0], layer.cumulative_length - N, scores[..., 0])
    layer.scores = scores[..., N - layer.keys.shape[-2]:]
    return k_all, v_all, _slots_attention_mask(titans, mask, kept, allowed, heads, k.dtype)


def titans_attention(attn: nn.Module, titans: TitansMemory, layer: TitansCacheLayer | None, attention,
                     q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor,
                     mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Titans layer's attention: the memory reads and writes x first (its surprise chooses the slots),
    then `attention` (the model's function) over the last W keys and the slots, then the gate mixes the
    memory in. q [B, H, T, d], k/v [B, G, N, d] (after the cache's update); out [B, T, H, d_v]."""
    seq, n_keys = hidden.shape[1], k.shape[-2]
    valid = new_token_validity(mask, seq, n_keys)  # [B, T] or None
    state = layer.memory if layer is not None else None
    pending = state.pending["k"].shape[2] if state is not None and state.pending else 0
    read, state, surprise = titans.read_write(hidden, valid, state, keep=layer is not None)
    mask = window_mask(mask, seq, n_keys, titans.window, q.dtype, q.device)
    if titans.slots:
        k, v, mask = _with_slots(titans, layer, k, v, mask, q.shape[1], seq, pending, surprise)
    out, weights = attention(attn, q, k, v, mask, **kwargs)
    if layer is not None:
        layer.memory = state
    return titans.blend(hidden, out, read), weights


# ---------------------------------------------------------------- the bounded cache


class TitansCacheLayer(DynamicSlidingWindowLayer):
    """The last W - 1 keys/values (transformers' sliding-window layer) plus the layer's memory state.

    The tokens read since the last chunk boundary sit in buffers of C slots allocated at the first
    write, so the state's size is the window's keys/values plus a constant: per token it grows by
    exactly the source's KV bytes until W, then not at all."""

    def __init__(self, sliding_window: int, chunk: int = 1, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.chunk = chunk
        self._memory: MemoryState | None = None
        self._pending: dict[str, torch.Tensor] = {}  # PENDING fields in C slots, [B, H, C, ...]
        self._filled = 0
        self.slots: Slots | None = None  # sparse slots: the most surprising tokens the window lost
        self.scores: torch.Tensor | None = None  # [B, G, W - 1]: the surprise of the window's keys (NaN: unknown)

    @property
    def memory(self) -> MemoryState | None:
        if self._memory is None:
            return None
        pending = {k: t[:, :, :self._filled] for k, t in self._pending.items()} if self._filled else {}
        return MemoryState(self._memory.weights, self._memory.momentum, pending)

    @memory.setter
    def memory(self, state: MemoryState | None) -> None:
        self._memory = None if state is None else MemoryState(state.weights, state.momentum)
        pending = {} if state is None else state.pending
        self._filled = pending["k"].shape[2] if pending else 0
        if state is not None and (not self._pending or self._pending["k"].shape[0] != state.weights[0].shape[0]):
            first, last = state.weights[0], state.weights[-1]  # [B, H, M, ·], [B, H, ·, M]
            vector = {"k": first.shape[-2], "v": last.shape[-1]}
            self._pending = {name: first.new_zeros(*first.shape[:2], self.chunk, *([vector[name]] if name in vector else []))
                           for name in PENDING}
        for name, t in pending.items():
            self._pending[name][:, :, :self._filled] = t

    def stored_bytes(self) -> int:
        tensors = [t for t in (self.keys, self.values) if isinstance(t, torch.Tensor)]
        tensors += (self._memory.tensors() if self._memory is not None else []) + list(self._pending.values())
        tensors += (self.slots.tensors() if self.slots is not None else []) + ([self.scores] if self.scores is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def reset(self) -> None:
        super().reset()
        self.memory = None
        self.slots, self.scores = None, None

    def _map_batch(self, fn) -> None:
        if self._memory is not None:
            self._memory = self._memory.map(fn)
        self._pending = {k: fn(t) for k, t in self._pending.items()}
        self.slots = self.slots.map(fn) if self.slots is not None else None
        self.scores = fn(self.scores) if self.scores is not None else None

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_batch(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a Titans cache cannot be cropped: the memory has already read those tokens")


class TitansCache(DynamicCache):
    """A DynamicCache of `TitansCacheLayer`s, one per decoder layer; its size is bounded by W and C."""

    def __init__(self, config) -> None:
        window, chunk = int(config.attnkit["window"]), int(config.attnkit["chunk"])
        Cache.__init__(self, layers=[TitansCacheLayer(window, chunk) for _ in range(config.num_hidden_layers)])


def titans_cache_layer(cache, layer_idx: int) -> TitansCacheLayer | None:
    """The layer of a Titans cache (None without a cache); any other non-empty cache is refused."""
    if cache is None:
        return None
    layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
    if not isinstance(layer, TitansCacheLayer):
        raise ValueError(f"a Titans model needs a TitansCache, got {type(cache).__name__} "
                         f"(pass no cache, or TitansCache(model.config))")
    return layer


def with_titans_cache(config, kwargs: dict) -> dict:
    """forward's kwargs with a fresh TitansCache where transformers would use (or passed) an empty
    default cache, so that `generate` and `use_cache=True` keep the bounded state."""
    use_cache = kwargs.get("use_cache")
    if not (config.use_cache if use_cache is None else use_cache):
        return kwargs
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None or (not isinstance(cache, TitansCache) and cache.get_seq_length() == 0):
        kwargs = {k: v for k, v in kwargs.items() if k != "past_key_values"}
        kwargs["cache"] = TitansCache(config)
    return kwargs
