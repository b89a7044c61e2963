"""Next-token cross-entropy without the whole [tokens, vocabulary] logits.

A causal LM's forward ends with the LM head over every position: at a 128,256-token vocabulary one
1,024-token row is 0.53 GB of fp32 logits, and the loss keeps about three such tensors alive (the logits,
the log-softmax autograd saves, their gradient): more than the trained parameters and their AdamW state
of a 1B model's attention. Here the forward stops before the head (`final_hidden`: a pre-hook hands the
head a zero-length sequence and keeps its input), and the loss runs the head's weight over a few hundred
positions at a time (`next_token_ce`), making each chunk's gradients as it goes: one chunk's logits at a
time, and the same arithmetic as the whole-logits loss and its backward. A head held in 16 bits (`frozen`) is
upcast a block of vocabulary rows at a time (`HeadBlocks`), so no whole fp32 copy of it exists either.

The head's output must be the logits: a model whose forward rescales them (Cohere's `logit_scale`,
Granite's `logits_scaling`) or does anything else to them is left to the whole-logits path; Gemma's final
soft-capping is applied here as its forward applies it. `matches` checks this on a few positions of the
model itself before the chunked loss is used."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

CHUNK_BYTES = 64 * 2**20  # fp32 logits per chunk
BLOCK_BYTES = 64 * 2**20  # fp32 head rows per block
RESCALING = ("logit_scale", "logits_scaling")  # config fields of forwards that rescale the head's output


def head_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The LM head of a causal LM (through accelerate's DDP wrapper), or None when the model has none or
    its forward rescales the head's output."""
    model = getattr(model, "module", model)
    config = getattr(model, "config", None)
    if config is None or any(getattr(config, key, None) not in (None, 1, 1.0) for key in RESCALING):
        return None
    get = getattr(model, "get_output_embeddings", None)
    return get() if get is not None else None


def softcap_of(model: torch.nn.Module) -> float | None:
    """Gemma's final logit soft-capping (logits = cap · tanh(logits / cap)), None without it."""
    cap = getattr(getattr(getattr(model, "module", model), "config", None), "final_logit_softcapping", None)
    return float(cap) if cap else None


class _Kept:
    hidden: torch.Tensor | None = None


@contextmanager
def final_hidden(head: torch.nn.Module | None) -> Iterator[_Kept]:
    """While open, the head's input is kept (`.hidden`, [B, L, D]) and the head sees none of its positions:
    the model's forward returns logits [B, 0, V]. With no head, nothing changes (`.hidden` stays None)."""
    kept = _Kept()
    if head is None:
        yield kept
        return

    def stop(module, args):
        kept.hidden = args[0]
        return (args[0][..., :0, :].detach(), *args[1:])

    handle = head.register_forward_pre_hook(stop, prepend=True)  # before `frozen`'s upcast: it sees no rows
    try:
        yield kept
    finally:
        handle.remove()


class HeadBlocks:
    """The head's weight [V, D] and bias [V] a block of vocabulary rows at a time, in the dtype its matmul runs
    in: as held under autocast (bf16 runs), else fp32, upcast block by block (a frozen head may be held in 16
    bits, `frozen`: no whole fp32 copy). The same blocks for an fp32 head, so both compute alike."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, upcast: bool, block_bytes: int = BLOCK_BYTES):
        self.weight, self.bias, self.upcast = weight, bias, upcast
        self.rows = max(1, block_bytes // (4 * weight.shape[1]))

    def __iter__(self) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor | None]]:
        """(rows, weight [rows, D], bias [rows] or None) for each block of vocabulary rows."""
        cast = (lambda x: x.float()) if self.upcast else (lambda x: x)  # noqa: E731
        for start in range(0, self.weight.shape[0], self.rows):
            part = slice(start, start + self.rows)
            yield part, cast(self.weight[part]), None if self.bias is None else cast(self.bias[part])


def _logits(h: torch.Tensor, head: HeadBlocks, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [..., V] of h [..., D], tanh(z / cap) or None): the head, block by block, soft-capped as Gemma's forward does."""
    logits = None
    for part, w, b in head:
        z = F.linear(h, w, b)  # [..., rows]
        if logits is None:
            logits = z.new_empty(*h.shape[:-1], head.weight.shape[0])
        logits[..., part] = z
    return capped(logits, softcap)


def capped(logits: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(softcap · tanh(logits / softcap), the tanh) as Gemma's forward caps its logits; (logits, None) without a cap."""
    if softcap is None:
        return logits, None
    cap = torch.tanh(logits / softcap)
    return cap * softcap, cap


def _ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (torch.logsumexp(logits, dim=-1) - logits.gather(-1, targets[:, None]).squeeze(-1)).sum()


def _blocks(head: torch.nn.Module, hidden: torch.Tensor, block_bytes: int | None = None) -> HeadBlocks:
    """The head's weight and bias by blocks (`HeadBlocks`). A weight still sharded (a DTensor: its owner did
    not leave it gathered after the model's forward) is refused."""
    from torch.distributed.tensor import DTensor

    weight, bias = head.weight, getattr(head, "bias", None)
    if isinstance(weight, DTensor):
        raise RuntimeError("the LM head's weight is sharded outside the model's forward: use whole logits")
    return HeadBlocks(weight, bias, not torch.is_autocast_enabled(hidden.device.type), block_bytes or BLOCK_BYTES)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `softcap(hidden @ weightᵀ + bias)` against `targets`, a chunk of rows at a time.
    The gradients are made in the forward, chunk by chunk (the softmax minus the one-hot target, through the
    cap and the head), and only they are kept: [N, D] for the hidden states, [V, D] for a head that trains.
    No module is called, so a sharded head is used as its owner left it gathered for the model's forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, softcap, rows, head):  # hidden [N, D], weight [V, D], targets [N]
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight.requires_grad else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and bias.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            h, y = hidden[start:start + rows].float(), targets[start:start + rows]  # [n, D], [n]
            logits, cap = _logits(h, head, softcap)  # [n, V]
            total += _ce_sum(logits, y)
            g = torch.softmax(logits, dim=-1)  # d loss / d logits: softmax − one-hot
            del logits
            g[torch.arange(len(y), device=y.device), y] -= 1
            if cap is not None:
                g *= 1 - cap * cap  # through cap · tanh(z / cap)
            gh = torch.zeros_like(h)  # [n, D]: the head's rows summed block by block
            for part, w, _ in head:
                gh += g[:, part] @ w
                if grad_w is not None:
                    grad_w[part] += g[:, part].T @ h
            grad_h[start:start + rows] = gh
            if grad_b is not None:
                grad_b += g.sum(0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grads = []
        for g, dtype in zip(ctx.saved_tensors, ctx.dtypes):
            grads.append(None if g is None else (g * grad_out).to(dtype))
        return (*grads, None, None, None, None)


def next_token_ce(hidden: torch.Tensor, input_ids: torch.Tensor, head: torch.nn.Module,
                  softcap: float | None = None, chunk_bytes: int | None = None,
                  block_bytes: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from positions ≤ t, the head run a chunk of positions at
    a time. hidden [B, L, D] (the head's input), ids [B, L]; equal to the loss on whole logits up to the
    order of the sums."""
    from attnkit.training import vocab_parallel

    vocab = head.weight.shape[0]
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # [B·(L−1), D]
    y = input_ids[:, 1:].reshape(-1)  # [B·(L−1)]
    rows = max(1, (chunk_bytes or CHUNK_BYTES) // (4 * vocab))  # positions per chunk
    if vocab_parallel.is_split(head):  # each process holds a block of the vocabulary (FSDP, fp32 runs)
        return vocab_parallel.next_token_ce_sum(h, y, head, softcap, rows) / h.shape[0]
    blocks = _blocks(head, hidden, block_bytes)
    if not torch.is_grad_enabled():  # validation: the loss alone
        total = sum(_ce_sum(_logits(h[i:i + rows].float(), blocks, softcap)[0], y[i:i + rows])
                    for i in range(0, h.shape[0], rows))
    else:
        total = _ChunkedCrossEntropy.apply(h, head.weight, getattr(head, "bias", None), y, softcap, rows, blocks)
    return total / h.shape[0]


@torch.no_grad()
def matches(model: torch.nn.Module, input_ids: torch.Tensor, positions: int = 8) -> bool:
    """Whether the model's own logits on the first `positions` tokens of the first row are the head over
    its final hidden states (soft-capped like Gemma's): the chunked loss computes the model's loss."""
    head = head_of(model)
    if head is None:
        return False
    ids = input_ids[:1, :positions]
    logits = model(input_ids=ids, use_cache=False).logits.float()
    try:
        with final_hidden(head) as kept:  # a head called by keyword or not at all fails here
            model(input_ids=ids, use_cache=False)
        mine = _head_logits(head, kept.hidden.float(), softcap_of(model))
    except (IndexError, TypeError, AttributeError, RuntimeError):
        return False
    return mine.shape == logits.shape and torch.allclose(mine, logits, rtol=1e-4, atol=1e-4)


def _head_logits(head: torch.nn.Module, hidden: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The logits the loss computes from the head's input: its weight as the loss will read it after the model's
    forward, or a vocabulary-split head's own forward (`vocab_parallel`: a collective, every process calls it)."""
    from attnkit.training import vocab_parallel

    if vocab_parallel.is_split(head):
        return capped(head(hidden), softcap)[0]
    blocks = _blocks(head, hidden)
    blocks.upcast = True
    return _logits(hidden, blocks, softcap)[0]


def checked_head(model: torch.nn.Module, device) -> torch.nn.Module | None:
    """The model's LM head when `matches` finds its logits to be the head's output (on 8 positions), else None."""
    probe = torch.arange(8, device=device).unsqueeze(0)  # [1, 8] token ids
    return head_of(model) if matches(model, probe) else None
