"""The teacher of a healing run: which model it is (`teacher: source` reads the student's conversion report),
the checks made before any weight is read (tokenizer, vocabulary, depth), and its loading: whole on one process
or DDP, its decoder layers sharded under FSDP. Frozen, held in its checkpoint's 16-bit dtype and computed in
fp32 (`frozen`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import weights_fingerprint
from attnkit.io.public import local_folder
from attnkit.io.resolve import BUNDLED, check_causal_lm, resolve_model
from attnkit.training import frozen, models, sharded_load
from attnkit.training.recipe import Recipe


def teacher_spec(recipe: Recipe, student_path: Path) -> str | None:
    """`teacher: source` means the model the student was converted from (its attnkit_report.json)."""
    if recipe.teacher != "source":
        return recipe.teacher
    report = student_path / "attnkit_report.json"
    try:
        source = json.loads(report.read_text())["source"]
        path = source.get("path")  # where the source was read from: relative to the student's folder (or absolute, older reports)
        local = local_folder(student_path, "attnkit_report.json", "source.path")  # outside the cwd: by name in the report
        if local is not None:
            return str(local)
        if path and not Path(path).is_absolute() and (student_path / path).is_dir() and path not in BUNDLED:
            return str((student_path / path).resolve())
        if path and Path(path).is_absolute() and Path(path).is_dir():
            return path
        return source["model"]
    except (OSError, ValueError, KeyError, TypeError):
        raise AttnkitError(f"teacher: source needs {report} with a source model; name the teacher instead") from None


def same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab() and (a.eos_token_id, a.bos_token_id) == (b.eos_token_id, b.bos_token_id)


def check_teacher(spec: str | None, tokenizer, student_vocab: int) -> tuple[Path | None, dict]:
    """Resolve the teacher and refuse a different tokenizer or logits width (before loading weights)."""
    if spec is None:
        return None, {}
    path = resolve_model(spec)
    config = check_causal_lm(path)
    if not same_tokenizer(tokenizer, models.load_tokenizer(path, "auto_map" in config)):
        raise AttnkitError(f"teacher {spec} has a different tokenizer than the student; distillation needs the same one")
    if config.get("vocab_size") != student_vocab:
        raise AttnkitError(f"teacher {spec} has vocab_size {config.get('vocab_size')}, the student {student_vocab}")
    return path, config


def same_weights(a: Path, b: Path) -> bool:
    """The same folder, or folders whose weights have the same index / safetensors header."""
    fingerprint = weights_fingerprint(a)
    return a.resolve() == b.resolve() or (fingerprint is not None and fingerprint == weights_fingerprint(b))


def check_same_depth(spec: str, teacher_config: dict, student_config: dict) -> None:
    """loss.hidden_weight matches layer l to layer l: the two models need the same depth and width."""
    for key in ("num_hidden_layers", "hidden_size"):
        if teacher_config.get(key) != student_config.get(key):
            raise AttnkitError(
                f"loss.hidden_weight needs a teacher as deep and wide as the student: teacher {spec} has "
                f"{key} {teacher_config.get(key)}, the student {student_config.get(key)} (set loss.hidden_weight=0)"
            )


def load_teacher(path: Path | None, config: dict, device, hold: bool = True):
    """The frozen source model in eval mode (no grads; run under torch.no_grad by the trainer), held in its
    checkpoint's 16-bit dtype and computed in fp32 (`frozen`): the fp32 teacher's outputs, half the bytes.
    `hold=False` (`train.frozen_dtype: fp32`): read in fp32, no upcast per call."""
    if path is None:
        return None
    teacher, dtype = _read_teacher(path, config, device, hold)
    frozen.compute_in_fp32(teacher)
    print(f"attnkit finetune: teacher loaded from {path}{_held_in(dtype)}", file=sys.stderr)
    return teacher


def _read_teacher(path: Path, config: dict, device, hold: bool) -> tuple[Any, torch.dtype]:
    dtype, trust = _held_dtype(path, hold), "auto_map" in config
    teacher = models.load_causal_lm(path, trust_remote_code=trust, dtype=dtype)
    frozen.fp32_buffers(teacher, path, trust)
    return teacher.to(device).eval().requires_grad_(False), dtype


def _held_dtype(path: Path, hold: bool) -> torch.dtype:
    """The dtype frozen weights of the checkpoint at `path` are held in: its 16-bit one when `hold`, else fp32."""
    return frozen.storage_dtype(path) if hold else torch.float32


def _held_in(dtype: torch.dtype) -> str:
    return "" if dtype == torch.float32 else f" (held in {str(dtype).removeprefix('torch.')}, computed in fp32)"


def load_fsdp_teacher(path: Path, config: dict, accelerator, hold: bool = True) -> tuple[Any, int]:
    """The frozen teacher under FSDP: its decoder layers sharded over the processes like the student's
    (`sharded_load.shard_teacher_layers`), each process reading only what it keeps from the checkpoint
    (`sharded_load.load_sharded`); a checkpoint whose names are not the model's is loaded whole on the
    CPU first. Held in its checkpoint's dtype like `load_teacher`'s: FSDP gathers the shards in the dtype
    the run computes in, the parts left whole are upcast module by module. Returns (teacher, layers sharded)."""
    shard = lambda model: sharded_load.shard_teacher_layers(model, accelerator)  # noqa: E731
    dtype = _held_dtype(path, hold)
    loaded = sharded_load.load_sharded(path, "auto_map" in config, accelerator.device, shard, dtype)
    if loaded is None:
        teacher, _ = _read_teacher(path, config, "cpu", hold)
        layers = shard(teacher)
        sharded_load.whole_to_device(teacher, accelerator.device)
        where = "read whole, then sharded"
    else:
        teacher, layers = loaded
        teacher.eval().requires_grad_(False)
        frozen.fp32_buffers(teacher, path, "auto_map" in config)
        where = "this process's shards only"
    frozen.compute_in_fp32(teacher)  # after sharding: only what FSDP leaves whole
    print(f"attnkit finetune: teacher loaded from {path}, {where}{_held_in(dtype)}", file=sys.stderr)
    return teacher, layers
