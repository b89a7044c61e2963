"""Run folder and exact resume: accelerate's save_state/load_state plus a small trainer_state.json.

Layout of RUN_DIR:
  run.json                    fingerprint of the recipe, process count (a different run is refused)
  log.jsonl                   one JSON object per logged step / evaluation
  tensorboard/                accelerate's TensorBoard tracker (if installed)
  checkpoints/step-000040/    model, optimizer, scheduler, RNG of every process + trainer_state.json

A checkpoint is written to a `.tmp-` sibling and renamed when complete, so a kill during the save
leaves the previous checkpoint as the newest one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from attnkit.errors import AttnkitError

RUN_FILE = "run.json"
STATE_FILE = "trainer_state.json"


def open_run_dir(run_dir: Path, fingerprint: str, world_size: int, is_main: bool) -> Path | None:
    """Check RUN_DIR belongs to this run; return the newest complete checkpoint (or None).

    Refuses (AttnkitError, nothing touched) a folder made by another recipe or process count.
    """
    run_file = run_dir / RUN_FILE
    if run_file.is_file():
        try:
            info = json.loads(run_file.read_text())
        except ValueError:
            raise AttnkitError(f"{run_file} is not valid JSON; use another run_dir") from None
        if info.get("fingerprint") != fingerprint:
            raise AttnkitError(
                f"run_dir {run_dir} holds checkpoints of a different run (recipe fingerprint "
                f"{info.get('fingerprint')} ≠ {fingerprint}); set run_dir to a new folder or delete it"
            )
        if info.get("world_size") != world_size:
            raise AttnkitError(
                f"run_dir {run_dir} was trained with {info.get('world_size')} processes, now {world_size}; "
                "resume with the same process count"
            )
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise AttnkitError(f"run_dir {run_dir} is not empty and was not made by attnkit finetune; use another")
    return latest_checkpoint(run_dir)


def claim_run_dir(run_dir: Path, fingerprint: str, world_size: int) -> None:
    """Main process: create RUN_DIR and stamp it with this run's fingerprint."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_FILE).write_text(json.dumps({"fingerprint": fingerprint, "world_size": world_size}, indent=2))


def latest_checkpoint(run_dir: Path) -> Path | None:
    folder = run_dir / "checkpoints"
    done = sorted(p for p in folder.glob("step-*") if (p / STATE_FILE).is_file()) if folder.is_dir() else []
    return done[-1] if done else None


def save_checkpoint(accelerator, run_dir: Path, step: int, trainer_state: dict, keep: int) -> Path:
    """All processes call this (each saves its RNG state); the main one finalises and prunes."""
    final = run_dir / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(f".tmp-{final.name}")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        done = sorted(p for p in final.parent.glob("step-*") if (p / STATE_FILE).is_file())
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def read_trainer_state(folder: Path) -> dict:
    """Step, tokens seen, loss curve … of a checkpoint (read before restoring, to position the data)."""
    try:
        return json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise AttnkitError(f"cannot resume from {folder}: {exc}") from None


def restore(accelerator, folder: Path) -> None:
    """Model, optimizer, scheduler and RNG states of every process, via accelerate's load_state."""
    try:
        accelerator.load_state(str(folder))
    except Exception as exc:  # a corrupt or foreign checkpoint
        raise AttnkitError(f"cannot resume from {folder}: {str(exc).splitlines()[0]}") from None
