"""Frozen vocabulary tables split by rows over the processes of an FSDP run that computes in fp32.

FSDP gathers a table in the run's compute dtype for every forward: at the Llama-3.2-1B width (128,256 × 2,048)
that is a 1 GB fp32 table per gather, the embeddings' for a lookup of a few rows. Held whole in 16 bits each
process still pays 0.5 GB per table. Split here, each process holds only its block of vocabulary rows, in the
checkpoint's 16 bits (a DTensor sharded on dim 0, FSDP's layout, so the checkpoint filling and the streamed
export treat it like any shard), and the modules compute on their block without ever gathering it:

* **embeddings** (`_embedding_forward`): every process's ids are gathered (a few KB), each process looks up
  the rows it owns (zeros elsewhere), and a sum over the processes gives everyone the rows: [P·n, D] fp32
  (times `embed_scale` for Gemma's scaled embeddings, `SCALED_EMBEDDINGS`).
* **LM head**: every process's hidden states are gathered and each process computes the logits of its own
  vocabulary block for all of them. The cross-entropy (`next_token_ce_sum`) is assembled from each row's maxima,
  sums of exponentials and target logit, summed over the processes (a few floats per row); its gradient for the
  hidden states is each block's share, summed the same way. Whole logits (the module's forward: probes, KL)
  gather the blocks' logits.

Every call is a collective: the processes must call these modules equally often, as they run every FSDP
forward. Rows are padded to the largest process's count, so the processes may hold different numbers of rows.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from attnkit.training.chunked_head import HeadBlocks, capped


def _world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _most(n: int, device: torch.device) -> int:
    """The largest `n` over the processes."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _gather_padded(x: torch.Tensor, rows: int, fill: float = 0) -> torch.Tensor:
    """x [n ≤ rows, ...] of every process, padded with `fill` to `rows`, stacked in rank order: [P·rows, ...]."""
    _, size = _world()
    padded = x.new_full((rows, *x.shape[1:]), fill)
    padded[:len(x)] = x
    out = x.new_empty((size * rows, *x.shape[1:]))
    dist.all_gather_into_tensor(out, padded.contiguous())
    return out


def owned_rows(weight: torch.Tensor) -> tuple[int, int]:
    """[lo, hi): the vocabulary rows this process holds of a table split on dim 0 (torch.chunk's blocks)."""
    rank, size = _world()
    block = -(-weight.shape[0] // size)
    lo = min(rank * block, weight.shape[0])
    return lo, min(lo + block, weight.shape[0])


def is_split(module: torch.nn.Module | None) -> bool:
    return bool(getattr(module, "_attnkit_vocab_split", False))


def split_tables(modules: list[torch.nn.Module], device_type: str) -> int:
    """Each module's weight (and an LM head's bias) replaced by a DTensor of this process's block of rows, its
    forward by the split computation; tied modules keep sharing one parameter. On the meta device the blocks
    stay there (allocated and filled later, as FSDP's shards are); real weights are cut, no communication.
    Returns how many tables (distinct weights) were split."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    done: dict[int, torch.nn.Parameter] = {}
    for module in modules:
        for name in ("weight", "bias"):
            param = module._parameters.get(name)
            if param is None:
                continue
            if id(param) not in done:
                done[id(param)] = torch.nn.Parameter(_split(param.detach(), mesh), requires_grad=False)
            module._parameters[name] = done[id(param)]
        forward = _embedding_forward if isinstance(module, torch.nn.Embedding) else _head_forward
        module.forward = types.MethodType(forward, module)
        module._attnkit_vocab_split = True
    return len({id(m.weight) for m in modules})


def _split(t: torch.Tensor, mesh) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if t.device.type != "meta":
        return distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)  # every process holds the same values
    lo, hi = owned_rows(t)
    local = torch.empty((hi - lo, *t.shape[1:]), dtype=t.dtype, device="meta")
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())


# transformers' embeddings whose forward is the lookup times a scalar buffer `embed_scale` (sqrt(hidden) in the
# Gemma family), `super().forward(ids) * self.embed_scale.to(self.weight.dtype)` in every one (transformers 5.x)
SCALED_EMBEDDINGS = frozenset({"GemmaTextScaledWordEmbedding", "Gemma2TextScaledWordEmbedding",
                               "Gemma3TextScaledWordEmbedding", "Gemma4TextScaledWordEmbedding",
                               "VaultGemmaTextScaledWordEmbedding"})


def splittable(module: torch.nn.Module) -> bool:
    """A plain embedding (no max_norm), a Gemma-style scaled one, or a plain linear LM head: the computations
    here are theirs."""
    from attnkit.training.frozen import built_class

    cls = built_class(module)
    embedding = cls is torch.nn.Embedding or (cls.__name__ in SCALED_EMBEDDINGS and issubclass(cls, torch.nn.Embedding)
                                              and isinstance(getattr(module, "embed_scale", None), torch.Tensor))
    return (embedding and module.max_norm is None) or cls is torch.nn.Linear


def _embedding_forward(self: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """The rows of `ids` [...] in fp32 [..., D], each process looking up those it holds."""
    rank, _ = _world()
    local = self.weight.to_local()  # [rows held, D], 16 bits
    flat = ids.reshape(-1)
    n = _most(len(flat), ids.device)
    every = _gather_padded(flat, n)  # [P·n]; padding looks up row 0, never returned
    if bool(((every < 0) | (every >= self.weight.shape[0])).any()):  # every process sees every id: all raise
        raise IndexError(f"token id out of range for an embedding of {self.weight.shape[0]} rows")
    lo, hi = owned_rows(self.weight)
    inside = (every >= lo) & (every < hi)
    rows = torch.zeros(len(every), local.shape[1], dtype=torch.float32, device=ids.device)  # [P·n, D]
    rows[inside] = local[every[inside] - lo].float()
    dist.all_reduce(rows)
    mine = rows[rank * n:rank * n + len(flat)].reshape(*ids.shape, local.shape[1])
    scale = getattr(self, "embed_scale", None)  # a scaled embedding's factor, in the fp32 its own forward would use
    return mine if scale is None else mine * scale.float()


def _local_blocks(head: torch.nn.Module) -> HeadBlocks:
    bias = getattr(head, "bias", None)
    return HeadBlocks(head.weight.to_local(), None if bias is None else bias.to_local(), upcast=True)


def _local_logits(x: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
    """x [m, D] fp32 → the logits of this process's vocabulary block [m, rows held], block by block."""
    blocks = _local_blocks(head)
    z = x.new_empty(len(x), blocks.weight.shape[0])
    for part, w, b in blocks:
        z[:, part] = F.linear(x, w, b)
    return z


def _head_forward(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Whole logits [..., V] of hidden [..., D]: each process's block for every process's rows, gathered."""
    rank, size = _world()
    vocab = self.weight.shape[0]
    x = hidden.reshape(-1, hidden.shape[-1]).float()
    n = _most(len(x), hidden.device)
    if n == 0:  # no process has rows (the chunked loss's stop, `chunked_head.final_hidden`)
        return hidden.new_zeros(*hidden.shape[:-1], vocab, dtype=torch.float32)
    z = _local_logits(_gather_padded(x, n), self)  # [P·n, rows held]
    block = -(-vocab // size)
    padded = z.new_zeros(len(z), block)
    padded[:, :z.shape[1]] = z
    parts = z.new_empty(size, len(z), block)  # every process's block of columns, for every row
    dist.all_gather_into_tensor(parts, padded[None].contiguous())
    mine = parts[:, rank * n:rank * n + len(x)]  # [P, n_mine, block]
    logits = mine.permute(1, 0, 2).reshape(len(x), size * block)[:, :vocab]
    return logits.reshape(*hidden.shape[:-1], vocab)


def _block_ce(h: torch.Tensor, y: torch.Tensor, head: torch.nn.Module, softcap: float | None, rows: int,
              want_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: (summed cross-entropy of this process's rows, d/dh of it [n, D] or None). h [n ≤ rows, D]."""
    rank, _ = _world()
    every_h, every_y = _gather_padded(h, rows), _gather_padded(y, rows, fill=-1)  # [P·rows, D], [P·rows]
    z, cap = capped(_local_logits(every_h, head), softcap)  # [P·rows, rows held]
    top = z.amax(-1) if z.shape[1] else z.new_full((len(z),), float("-inf"))
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(z - top[:, None])  # [P·rows, rows held]
    sums = e.sum(-1)
    dist.all_reduce(sums)
    lse = top + torch.log(sums)  # [P·rows]
    lo, hi = owned_rows(head.weight)
    inside = (every_y >= lo) & (every_y < hi)
    target = torch.zeros_like(lse)
    target[inside] = z[inside, every_y[inside] - lo]
    dist.all_reduce(target)
    mine = slice(rank * rows, rank * rows + len(h))
    loss = (lse - target)[mine].sum()
    if not want_grad:
        return loss, None
    g = e.div_(sums[:, None])  # d loss / d logits: softmax − one-hot, this block's columns (in place: no second exp)
    g[inside, every_y[inside] - lo] -= 1
    if cap is not None:
        g *= 1 - cap * cap  # through cap · tanh(z / cap)
    grad = torch.zeros_like(every_h)
    for part, w, _ in _local_blocks(head):
        grad += g[:, part] @ w
    dist.all_reduce(grad)  # every block's share
    return loss, grad[mine]


class _SplitCrossEntropy(torch.autograd.Function):
    """Summed next-token cross-entropy over a split LM head, the hidden states' gradient made in the forward
    a chunk of rows at a time (as `chunked_head._ChunkedCrossEntropy`; the head is frozen: no weight gradient)."""

    @staticmethod
    def forward(ctx, hidden, targets, head, softcap, rows):  # hidden [n, D], targets [n]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        for part, width in _chunks(len(hidden), rows, hidden.device):
            loss, grad = _block_ce(hidden[part].float(), targets[part], head, softcap, width, True)
            total += loss
            grad_h[part] = grad
        ctx.save_for_backward(grad_h)
        ctx.dtype = hidden.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        (grad_h,) = ctx.saved_tensors
        return (grad_h * grad_out).to(ctx.dtype), None, None, None, None


def next_token_ce_sum(h: torch.Tensor, y: torch.Tensor, head: torch.nn.Module, softcap: float | None,
                      rows: int) -> torch.Tensor:
    """Summed cross-entropy of h [n, D] against targets y [n] over a split head, `rows` positions a chunk."""
    if torch.is_grad_enabled() and h.requires_grad:
        return _SplitCrossEntropy.apply(h, y, head, softcap, rows)
    return sum((_block_ce(h[part].float(), y[part], head, softcap, width, False)[0]
                for part, width in _chunks(len(h), rows, h.device)), torch.zeros((), device=h.device))


def _chunks(n: int, rows: int, device: torch.device) -> list[tuple[slice, int]]:
    """(this process's slice, the rows every process pads it to) for each chunk: as many chunks on every
    process, each as wide as the most rows any process has in it (a process out of rows sends none)."""
    most = _most(n, device)
    return [(slice(start, start + rows), min(rows, most - start)) for start in range(0, most, rows)]
