"""The end of a healing run: an HF checkpoint that loads like the input did, plus its reports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from attnkit.io.checkpoint import atomic_output_dir

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


def save_healed(
    model: torch.nn.Module,
    tokenizer,
    student_path: Path,
    out: Path,
    force: bool,
    dtype: torch.dtype,
    report: dict,
    state_dict: dict | None = None,
) -> Path:
    """Write OUT atomically: weights (input dtype), config, tokenizer, remote code, reports, README."""
    with atomic_output_dir(out, force) as tmp:
        if state_dict is None:
            model.to(dtype).save_pretrained(tmp, safe_serialization=True)
        else:  # gathered from FSDP/DeepSpeed shards
            model.config.dtype = dtype
            tied = getattr(model, "all_tied_weights_keys", None) or {}  # {target: source}, e.g. lm_head -> embed_tokens
            # gathered copies share no storage, so save_pretrained would write a tied weight twice
            drop = {k for k, source in tied.items() if k in state_dict and source in state_dict}
            model.save_pretrained(tmp, state_dict={k: v.to(dtype) for k, v in state_dict.items() if k not in drop},
                                  safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for src in student_path.glob("*.py"):  # remote modeling code referenced by auto_map
            if not (tmp / src.name).exists():
                shutil.copy2(src, tmp / src.name)
        if (student_path / CONVERT_REPORT).is_file():  # keep the conversion's story in the card
            _copy_convert_report(student_path, tmp)
        (tmp / FINETUNE_REPORT).write_text(json.dumps(report, indent=2, default=str))
        _write_card(tmp)
    return out


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
