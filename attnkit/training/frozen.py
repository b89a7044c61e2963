"""Frozen weights kept in their checkpoint's 16-bit dtype and computed in fp32, one module at a time.

bf16 and fp16 convert to fp32 exactly, so a module that works on an fp32 copy of its own 16-bit parameters
during its own forward computes what the same checkpoint loaded in fp32 computes, bit for bit, and the
model holds half the bytes between calls. The copies live one module at a time. A plain embedding table is
not copied: its rows are looked up in 16 bits and upcast, the same values without a whole fp32 table.

* The teacher (`compute_in_fp32`): all of it (the Llama-3.2-1B shape's: 2.4 GB instead of 4.7 GB).
* The student (`hold_frozen`): the parameters that do not train; the trained ones stay fp32 master
  weights. Autograd would keep each layer's fp32 copy from its forward to the backward; under
  `saved_in_low_precision` it keeps the 16-bit parameter and upcasts it again when the backward needs it.

Parameters FSDP shards are left to FSDP: its mixed-precision policy gathers them in the dtype the run
computes in (`sharded_load.shard_teacher_layers`). A checkpoint stored in fp32, or in more than one float
dtype, is loaded in fp32 as before."""

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

    if not any(p.dtype in LOW_PRECISION for p in model.parameters()):
        return  # built in fp32: its buffers are the fp32 load's already
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


# storage of each fp32 copy alive -> its 16-bit parameter, while the module owning it runs its forward
_SOURCES: dict[int, torch.Tensor] = {}


def _upcast_own(module: torch.nn.Module, names: tuple[str, ...], stand_in: bool = False) -> None:
    """The module's 16-bit parameters replaced by fp32 copies for its forward (the parameter objects are
    set aside, not changed: autograd may hold them). `stand_in` (a call on no rows): fp32 tensors of the
    same shapes that hold one zero (`expand`), no copy; the forward computes nothing from them."""
    stash = {}
    for name in names:
        low = module._parameters[name]
        if stand_in:
            copy = torch.zeros((), dtype=torch.float32, device=low.device).expand(low.shape)
        else:
            copy = low.float()
            if copy.numel():  # an empty tensor has no storage address of its own
                _SOURCES[copy.untyped_storage().data_ptr()] = low
        stash[name] = low
        module._parameters[name] = copy
    module._attnkit_low_precision = stash


def _restore_own(module: torch.nn.Module) -> None:
    for name, low in module.__dict__.pop("_attnkit_low_precision", {}).items():
        if module._parameters[name].numel():
            _SOURCES.pop(module._parameters[name].untyped_storage().data_ptr(), None)
        module._parameters[name] = low


def _pack(t: torch.Tensor):
    """What autograd keeps of a tensor it saves for the backward: of an fp32 copy of a 16-bit parameter
    (or a view of one, e.g. a linear layer's transposed weight), the parameter and the view's geometry."""
    if not _SOURCES or t.dtype != torch.float32 or not t.numel() or type(t) is not torch.Tensor:
        return t  # nothing held in 16 bits is running, or not a plain fp32 tensor (a subclass keeps its own)
    low = _SOURCES.get(t.untyped_storage().data_ptr())
    return t if low is None else (low, t.size(), t.stride(), t.storage_offset())


def _unpack(packed):
    if isinstance(packed, tuple):
        low, size, stride, offset = packed
        return low.float().as_strided(size, stride, offset)  # the same values the forward saw
    return packed


def saved_in_low_precision():
    """Context for a training forward through a model whose frozen parameters are held in 16 bits
    (`hold_frozen`): the backward re-upcasts them instead of keeping every layer's fp32 copy alive from the
    forward to the backward."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)


def cast_frozen(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """The frozen (requires_grad False) fp32 parameters of a model read from a checkpoint stored in `dtype`
    (16-bit: their values are exact in it) cast back to `dtype`; on the meta device too, where FSDP then
    shards them in `dtype`. Trained parameters stay fp32 (AdamW's master weights). Returns how many."""
    cast = 0
    for param in {id(p): p for p in model.parameters()}.values():  # tied ones once
        if not param.requires_grad and param.dtype == torch.float32 and not _is_dtensor(param):
            param.data = param.data.to(dtype)
            cast += 1
    return cast


def hold_frozen(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """`cast_frozen`, and the model hooked to compute in fp32 (`compute_in_fp32`); train its forward under
    `saved_in_low_precision`. Returns how many parameters were cast."""
    cast = cast_frozen(model, dtype)
    compute_in_fp32(model)
    return cast


def _no_rows(args: tuple) -> bool:
    """A call on an empty input (the chunked cross-entropy's LM head, `chunked_head.final_hidden`)."""
    return bool(args) and torch.is_tensor(args[0]) and args[0].numel() == 0


def built_class(module: torch.nn.Module) -> type:
    """The module's class as the model built it: FSDP2's `fully_shard` swaps it for a subclass
    `FSDP<Name>(FSDPModule, <Name>)`, also on a module whose parameters it leaves alone."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    return next(b for b in cls.__bases__ if b is not FSDPModule) if isinstance(module, FSDPModule) else cls


def compute_in_fp32(model: torch.nn.Module) -> int:
    """Hook every module that owns 16-bit parameters (FSDP-sharded ones excepted) so that its forward sees
    them in fp32 and they return to 16 bits after it, even when it raises. Returns the number of modules
    hooked. For frozen parameters only: the fp32 copies are not what an optimizer would step."""
    hooked = 0
    for module in model.modules():
        names = tuple(n for n, p in module._parameters.items()
                      if p is not None and p.dtype in LOW_PRECISION and not _is_dtensor(p))
        if not names:
            continue
        if built_class(module) is torch.nn.Embedding:  # look rows up in 16 bits, upcast them: no fp32 table
            module.register_forward_hook(lambda m, args, out: out.float())
        else:
            module.register_forward_pre_hook(lambda m, args, names=names: _upcast_own(m, names, _no_rows(args)))
            module.register_forward_hook(lambda m, args, out: _restore_own(m), always_call=True)
        hooked += 1
    return hooked
