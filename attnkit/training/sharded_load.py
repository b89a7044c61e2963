"""Models loaded under FSDP without a whole copy on every process.

`from_pretrained` reads the whole checkpoint (in fp32, as the trainer runs) on every process, and FSDP then
keeps each process's shard: with N processes on one host that is N whole copies of the student and N of the
teacher at once, before training starts (a 70B pair on 8 GPUs: 16 × 280 GB of host memory). Here:

* the **teacher** is built with its parameters on the meta device, its decoder layers are sharded and its
  embeddings and LM head sharded or split by vocabulary rows (`shard_teacher_layers`), memory is allocated
  for this process's shards and its whole parts only, and each is filled from the checkpoint one tensor at a
  time (`load_sharded`);
* the **student** is built the same way on every process (`empty_student`), accelerate's FSDP2 preparation
  shards it on the meta device with its own loading turned off (`shards_only`), and each process then fills
  its shards from the checkpoint one tensor at a time (`fill_prepared`). No process reads it whole: with
  accelerate's `fsdp_cpu_ram_efficient_loading` alone, the main process would read it whole in fp32 and
  broadcast it. A checkpoint whose names are not the model's falls back to accelerate's loading.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import LazyCheckpoint
from attnkit.sdpa import fused_kwargs
from attnkit.training import vocab_parallel
from attnkit.training.frozen import LOW_PRECISION
from attnkit.training.trainable import canonical_name, constant_channel_map


def empty_causal_lm(path: Path, trust_remote_code: bool, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The causal LM of `path`'s config, its parameters in `dtype` on the meta device (no memory) and its
    buffers real: the RoPE tables are computed when the model is built and are not in the checkpoint."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code,
                                                     **fused_kwargs(path))
    except Exception as exc:
        raise AttnkitError(f"cannot build {path} as a causal LM: {str(exc).splitlines()[0]}") from None
    _tie(model)  # from_pretrained ties after loading; from_config leaves the LM head its own (meta) weight
    return model


def _tie(model: torch.nn.Module) -> None:
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()


def missing_from_checkpoint(model: torch.nn.Module, ckpt: LazyCheckpoint) -> list[str]:
    """The model's parameters (tied ones once) that the checkpoint does not hold under the same name:
    a model whose class renames its checkpoint's keys cannot be filled tensor by tensor."""
    return [name for name, _ in model.named_parameters() if name not in ckpt]


def _empty_matching(path: Path, trust_remote_code: bool,
                    dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, LazyCheckpoint] | None:
    """The causal LM of `path` on the meta device (`empty_causal_lm`) and its checkpoint, or None when the
    checkpoint's names are not the model's (it cannot be filled tensor by tensor)."""
    model = empty_causal_lm(path, trust_remote_code, dtype)
    ckpt = LazyCheckpoint(path)
    return None if missing_from_checkpoint(model, ckpt) else (model, ckpt)


def load_sharded(path: Path, trust_remote_code: bool, device: torch.device, shard: Callable[[torch.nn.Module], int],
                 dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, int] | None:
    """The model of `path`, its parameters in `dtype`, with `shard(model)` applied on the meta device (it
    returns how many modules it sharded), then this process's shards and the unsharded parameters allocated
    on `device` and read from the checkpoint; buffers keep their computed values. None when the checkpoint's
    names are not the model's (the caller loads it whole instead)."""
    found = _empty_matching(path, trust_remote_code, dtype)
    if found is None:
        return None
    model, ckpt = found
    sharded = shard(model)
    _allocate_and_fill(model, ckpt, device)
    return model, sharded


def empty_student(path: Path, trust_remote_code: bool) -> tuple[torch.nn.Module, dict[str, list[int]]] | None:
    """The student on the meta device and its constant MLA latent channels (`trainable.constant_channel_map`,
    their projections read from the checkpoint), or None when the checkpoint's names are not the model's."""
    found = _empty_matching(path, trust_remote_code)
    return None if found is None else (found[0], constant_channel_map(*found))


@contextmanager
def shards_only(accelerator, split: Sequence[torch.nn.Module] = ()) -> Iterator[None]:
    """accelerate's FSDP2 preparation of a model on the meta device, without its own loading: with
    `cpu_ram_efficient_loading` it would broadcast the main process's weights, which are not read yet.
    Without a compute dtype in its mixed-precision policy (fp32 runs), the shards are gathered in fp32:
    frozen ones held in 16 bits (`frozen.cast_frozen`) are then computed in fp32 like the rest. The tables in
    `split` (`vocab_tables`) are left out of FSDP (its `ignored_modules`) and split by vocabulary rows instead
    (`vocab_parallel`): each process allocates its block of rows, filled from the checkpoint after."""
    plugin = accelerator.state.fsdp_plugin
    loading, policy, ignored = plugin.cpu_ram_efficient_loading, plugin.mixed_precision_policy, plugin.ignored_modules
    plugin.cpu_ram_efficient_loading = False
    plugin.mixed_precision_policy = computing_policy(policy)
    if split:
        vocab_parallel.split_tables(list(split), accelerator.device.type)
        for module in split:  # accelerate moves ignored modules to the device: a meta tensor cannot be moved
            module.to_empty(device=accelerator.device)  # this process's rows only
        plugin.ignored_modules = list(split)
    try:
        yield
    finally:
        plugin.cpu_ram_efficient_loading, plugin.mixed_precision_policy = loading, policy
        plugin.ignored_modules = ignored


def vocab_tables(model: torch.nn.Module, accelerator, frozen_only: bool = True) -> list[torch.nn.Module]:
    """The model's input embeddings and LM head to split by vocabulary rows (`vocab_parallel`) rather than shard
    with FSDP: when every parameter they own is held in 16 bits (`frozen.cast_frozen`; `frozen_only`: and does
    not train) and the run computes in fp32 (`--mixed_precision no`, as CPU processes run). FSDP would gather a
    whole table in fp32 for each forward (the embeddings: for a lookup of a few rows) and keep the LM head
    gathered from the forward's end to the backward's start, each gather with its all-gather buffers besides:
    on the Llama-3.2-1B width, 1 GB tables, +2.0 GB for the embeddings' gather and +1.7 GB for the head's, per
    process, every step. Split, each process holds 1/P of each table in 16 bits and never gathers it. A bf16
    run gathers them in bf16 as before (its mix with fp32-computed modules has not been run here), and so does
    FSDP under parameter offload. Tied tables are split together or not at all."""
    if not _split_tables_pay(accelerator):
        return []
    found = _table_modules(model)
    ok = [m for m in found if _in_16_bits(m) and vocab_parallel.splittable(m)
          and not (frozen_only and any(p.requires_grad for p in m.parameters()))]
    tied = len(found) == 2 and found[0].weight is found[1].weight
    return ([] if len(ok) < 2 else ok) if tied else ok


def _table_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """[input embeddings, LM head] that the model has (one module once)."""
    found = []
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, get, lambda: None)()
        if module is not None and module not in found:
            found.append(module)
    return found


def _in_16_bits(module: torch.nn.Module) -> bool:
    """The module owns parameters, every one held in 16 bits (`frozen.LOW_PRECISION`)."""
    params = list(module.parameters())
    return bool(params) and all(p.dtype in LOW_PRECISION for p in params)


def _split_tables_pay(accelerator) -> bool:
    """Whether frozen 16-bit vocabulary tables are split rather than sharded: where the run computes in fp32
    (FSDP would gather them in fp32) and FSDP does not offload parameters (see `vocab_tables`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return getattr(accelerator, "mixed_precision", "no") == "no" and \
        not isinstance(getattr(accelerator.state.fsdp_plugin, "cpu_offload", None), CPUOffloadPolicy)


def computing_policy(policy):
    """FSDP2's mixed-precision policy with a compute dtype: the run's (bf16 on GPUs), else fp32, so that shards
    held in 16 bits (`frozen`) are gathered in the dtype the run computes in."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = policy or MixedPrecisionPolicy()
    return policy if policy.param_dtype is not None else dataclasses.replace(policy, param_dtype=torch.float32)


def shard_device(accelerator) -> torch.device:
    """Where FSDP keeps this process's shards: the CPU under `fsdp_offload_params` (FSDP2's CPUOffloadPolicy
    copies each to the GPU for its all-gather), else the process's device."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    offload = getattr(accelerator.state.fsdp_plugin, "cpu_offload", None)
    return torch.device("cpu") if isinstance(offload, CPUOffloadPolicy) else accelerator.device


def fill_prepared(model: torch.nn.Module, path: Path, device: torch.device) -> None:
    """A model sharded on the meta device (by accelerate or `shard`): this process's shards allocated on
    `device`, then read from the checkpoint. The parameter objects stay the ones the optimizer holds
    (`to_empty` swaps a DTensor's contents in place)."""
    _allocate_and_fill(model, LazyCheckpoint(path), device)


def _allocate_and_fill(model: torch.nn.Module, ckpt: LazyCheckpoint, device: torch.device) -> None:
    materialize(model, device)
    fill_from_checkpoint(model, ckpt, device)


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Memory on `device` for every parameter (a sharded one: this process's shard only, `to_empty`),
    the buffers' values kept and tied weights tied again (`to_empty` makes new tensors of both)."""
    buffers = {name: b for name, b in model.named_buffers()}
    model.to_empty(device=device)
    for name, value in buffers.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[attr] = value.to(device)
    _tie(model)


@torch.no_grad()
def fill_from_checkpoint(model: torch.nn.Module, ckpt: LazyCheckpoint, device: torch.device) -> None:
    """Every parameter read from the checkpoint, one whole tensor at a time (fp32 on `device`); a sharded
    parameter (DTensor) keeps the rows of its own shard, as `distribute_tensor` lays them out. A buffer the
    checkpoint also holds (a persistent one) takes the checkpoint's value, as `from_pretrained` gives it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, buffer in model.named_buffers():
        if canonical_name(name) in ckpt:
            buffer.copy_(_read(ckpt, canonical_name(name), buffer, device))
    for name, param in model.named_parameters():  # names in activation-checkpoint wrappers made canonical
        full = _read(ckpt, canonical_name(name), param, device)
        if isinstance(param, DTensor):
            mine = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(mine.to_local())
        else:
            param.copy_(full)


def _read(ckpt: LazyCheckpoint, name: str, like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The checkpoint's tensor `name` in `like`'s dtype on `device`, refused in one line when its shape is not
    `like`'s (the global shape for a sharded parameter)."""
    full = ckpt.get(name, dtype=like.dtype, device=device)
    if tuple(full.shape) != tuple(like.shape):
        raise AttnkitError(f"{name} in {ckpt.folder} has shape {tuple(full.shape)}, its config makes {tuple(like.shape)}")
    return full


def shard_teacher_layers(teacher: torch.nn.Module, accelerator) -> int:
    """FSDP: the frozen teacher sharded over the processes like the student (fully_shard per decoder layer,
    each its own unit: gathered for its forward, freed after). Its input embeddings and LM head, held in 16
    bits in a run that computes in fp32, are split by vocabulary rows like the student's (`vocab_tables`; tied
    ones too); else, when they are two tensors, each is a unit of its own (a 70B model's are 8.4 GB in fp32).
    Tied fp32 tables, the final norm and the rotary tables stay whole on every process. Units below the top
    level let the trainer call the base model alone (no LM head) when only hidden states are matched.
    fully_shard moves each process's shard to the device of the default mesh (the GPU of this process; the CPU
    under gloo), so no device ever holds it whole; on the meta device the shards stay there. Returns the number
    of decoder layers sharded (0: no decoder-layer class known, the teacher stays replicated)."""
    from torch.distributed.fsdp import fully_shard

    names = set(getattr(teacher, "_no_split_modules", None) or [])
    layers = [m for m in teacher.modules() if type(m).__name__ in names]
    policy = computing_policy(accelerator.state.fsdp_plugin.mixed_precision_policy)
    split = vocab_tables(teacher, accelerator, frozen_only=False) if layers else []  # frozen: built trainable
    if split:
        vocab_parallel.split_tables(split, accelerator.device.type)
    tables = [] if split or not layers else _untied_embeddings(teacher)
    for unit in layers + tables:
        fully_shard(unit, reshard_after_forward=True, mp_policy=policy)
    return len(layers)


def _untied_embeddings(model: torch.nn.Module) -> list[torch.nn.Module]:
    """[input embeddings, LM head] when they hold two different weights; [] when tied or absent."""
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if inp is None or out is None or out.weight is inp.weight:
        return []
    return [inp, out]


def whole_to_device(teacher: torch.nn.Module, device: torch.device) -> None:
    """Embeddings, final norm, LM head, rotary buffers (what is not sharded) moved whole to `device`."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for module in teacher.modules():
            for param in module._parameters.values():
                if param is not None and not isinstance(param, DTensor):
                    param.data = param.data.to(device)
            for name, buffer in module._buffers.items():
                if buffer is not None and not isinstance(buffer, DTensor):
                    module._buffers[name] = buffer.to(device)
