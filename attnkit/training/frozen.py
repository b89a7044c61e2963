"""The frozen teacher kept in its checkpoint's 16-bit dtype and computed in fp32, one module at a time.

bf16 and fp16 convert to fp32 exactly, so a teacher stored in bf16 whose every module works on an fp32 copy
of its own parameters during its own forward computes what the same checkpoint loaded in fp32 computes,
bit for bit, and holds half the bytes between calls (the Llama-3.2-1B shape's teacher: 2.4 GB instead of
4.7 GB per process). The copies live one module at a time. A plain embedding table is not copied: its
rows are looked up in 16 bits and upcast, the same values without a whole fp32 table.

Parameters FSDP shards are left to FSDP: its mixed-precision policy gathers them in the dtype the run
computes in (`sharded_load.shard_teacher_layers`). A checkpoint stored in fp32, or in more than one float
dtype, is loaded in fp32 as before.
"""

from __future__ import annotations

from pathlib import Path

import torch

from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import FLOAT_DTYPES, LazyCheckpoint

LOW_PRECISION = (torch.bfloat16, torch.float16)


def storage_dtype(path: Path) -> torch.dtype:
    """The 16-bit dtype every floating tensor of the checkpoint at `path` is stored in, else fp32 (read from
    the safetensors headers; no tensor data). fp32 too for weights not in safetensors (`from_pretrained`
    reads them as before)."""
    try:
        header = LazyCheckpoint(path).header()
    except AttnkitError:
        return torch.float32
    dtypes = {FLOAT_DTYPES.get(h["dtype"]) for h in header.values()} - {None}
    if len(dtypes) == 1 and next(iter(dtypes)) in LOW_PRECISION:
        return next(iter(dtypes))
    return torch.float32


def fp32_buffers(model: torch.nn.Module, path: Path, trust_remote_code: bool) -> None:
    """The buffers an fp32 load has. A model built in 16 bits computes its non-persistent buffers (Gemma's
    embedding scale, RoPE tables of some classes) in that dtype, rounded: they are taken from the same class
    built in fp32 on the meta device (its buffers are real, its parameters take no memory); persistent
    buffers, read from the checkpoint, are upcast."""
    from attnkit.training.sharded_load import empty_causal_lm

    fp32 = dict(empty_causal_lm(path, trust_remote_code).named_buffers())
    for name, buffer in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if leaf in module._non_persistent_buffers_set:
            module._buffers[leaf] = fp32[name].to(buffer.device)
        elif buffer.dtype in LOW_PRECISION:
            module._buffers[leaf] = buffer.float()


def _is_dtensor(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def _upcast_own(module: torch.nn.Module, names: tuple[str, ...]) -> None:
    stash = {}
    for name in names:
        param = module._parameters[name]
        stash[name] = param.data
        param.data = param.data.float()
    module._attnkit_low_precision = stash


def _restore_own(module: torch.nn.Module) -> None:
    for name, data in module.__dict__.pop("_attnkit_low_precision", {}).items():
        module._parameters[name].data = data


def compute_in_fp32(model: torch.nn.Module) -> int:
    """Hook every module that owns 16-bit parameters (FSDP-sharded ones excepted) so that its forward sees
    them in fp32 and they return to 16 bits after it, even when it raises. Returns the number of modules
    hooked. Only for a frozen model: the fp32 copies are not parameters autograd would train."""
    hooked = 0
    for module in model.modules():
        names = tuple(n for n, p in module._parameters.items()
                      if p is not None and p.dtype in LOW_PRECISION and not _is_dtensor(p))
        if not names:
            continue
        if type(module) is torch.nn.Embedding:  # look rows up in 16 bits, upcast them: no fp32 table
            module.register_forward_hook(lambda m, args, out: out.float())
        else:
            module.register_forward_pre_hook(lambda m, args, names=names: _upcast_own(m, names))
            module.register_forward_hook(lambda m, args, out: _restore_own(m), always_call=True)
        hooked += 1
    return hooked
