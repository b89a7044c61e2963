"""The end of a healing run: an HF checkpoint that loads like the input did, plus its reports."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from attnkit.io.checkpoint import ShardedWriter, atomic_output_dir
from attnkit.training.trainable import canonical_name

CONVERT_REPORT = "attnkit_report.json"
FINETUNE_REPORT = "finetune_report.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def input_dtype(config: dict) -> torch.dtype:
    """The dtype the input checkpoint was stored in (config `dtype` / `torch_dtype`), fp32 if unknown."""
    return _DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), torch.float32)


def final_model(model: torch.nn.Module, merge: bool) -> torch.nn.Module:
    """Merge LoRA adapters into the base weights when asked (PEFT's merge_and_unload)."""
    from peft import PeftModel

    if isinstance(model, PeftModel) and merge:
        return model.merge_and_unload()
    return model


def gathered_tensors(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor in `dtype`) for each entry of an FSDP2 model's state dict, one at a time: a sharded
    entry is gathered when reached (a collective: every process runs through the whole iterator, in the same
    order), so no process ever holds more than one whole tensor; `accelerator.get_state_dict` would gather
    the whole model on the main process (a 70B student: 280 GB of host memory in fp32)."""
    from torch.distributed.tensor import DTensor

    for name, value in model.state_dict().items():
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        yield canonical_name(name), whole.detach().to("cpu", dtype)


def save_healed(
    model: torch.nn.Module,
    tokenizer,
    student_path: Path,
    out: Path,
    force: bool,
    dtype: torch.dtype,
    report: dict,
    state_dict: dict | Iterable[tuple[str, torch.Tensor]] | None = None,
) -> Path:
    """Write OUT atomically: weights (input dtype), config, tokenizer, remote code, reports, README.
    `state_dict`: the weights gathered from FSDP/DeepSpeed shards, as a dict or streamed (`gathered_tensors`)."""
    with atomic_output_dir(out, force) as tmp:
        if state_dict is None:
            model.to(dtype).save_pretrained(tmp, safe_serialization=True)
        elif isinstance(state_dict, dict):  # gathered from DeepSpeed shards
            model.config.dtype = dtype
            drop = tied_copies(model, state_dict)
            model.save_pretrained(tmp, state_dict={k: v.to(dtype) for k, v in state_dict.items() if k not in drop},
                                  safe_serialization=True)
        else:
            _write_streamed(model, state_dict, tmp, dtype)
        tokenizer.save_pretrained(tmp)
        for src in student_path.glob("*.py"):  # remote modeling code referenced by auto_map
            if not (tmp / src.name).exists():
                shutil.copy2(src, tmp / src.name)
        if (student_path / CONVERT_REPORT).is_file():  # keep the conversion's story in the card
            _copy_convert_report(student_path, tmp)
        (tmp / FINETUNE_REPORT).write_text(json.dumps(report, indent=2, default=str))
        _write_card(tmp)
    return out


def tied_copies(model: torch.nn.Module, names) -> set[str]:
    """The names among `names` that are tied copies of another one in it (e.g. lm_head -> embed_tokens):
    gathered copies share no storage, so they would be written twice."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}  # {target: source}
    return {k for k, source in tied.items() if k in names and source in names}


def _write_streamed(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], tmp: Path,
                    dtype: torch.dtype) -> None:
    """The weights written shard by shard as they arrive (attnkit's ShardedWriter), then the config."""
    names = {canonical_name(n) for n in model.state_dict()}
    drop = tied_copies(model, names)
    writer = ShardedWriter(tmp, max_shard_bytes=5 * 1024**3)
    for name, tensor in tensors:
        if name not in drop:
            writer.add(name, tensor)
    writer.close()
    model.config.dtype = dtype
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(tmp)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(tmp)


def _copy_convert_report(student_path: Path, tmp: Path) -> None:
    """The student's conversion report, its source folder (written relative to the student's folder)
    made absolute again so that it is written relative to the new output when the folder is complete."""
    try:
        report = json.loads((student_path / CONVERT_REPORT).read_text(encoding="utf-8"))
        path = report["source"]["path"]
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError):
        shutil.copy2(student_path / CONVERT_REPORT, tmp / CONVERT_REPORT)
        return
    from attnkit.io.public import local_folder

    local = local_folder(student_path, CONVERT_REPORT, "source.path")
    if local is not None:
        report["source"]["path"] = str(local)
    elif isinstance(path, str) and path and not Path(path).is_absolute() and (student_path / path).is_dir():
        report["source"]["path"] = str((student_path / path).resolve())
    (tmp / CONVERT_REPORT).write_text(json.dumps(report, indent=2), encoding="utf-8")


def _write_card(folder: Path) -> None:
    try:
        from attnkit.card.build import write_model_card
    except ModuleNotFoundError:  # the publish engineer's module; older checkouts lack it
        return
    write_model_card(folder)
