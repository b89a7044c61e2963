"""Multi-process and resume equivalence of the trainer, run as real separate processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_finetune_fixtures import base_recipe, tiny, write_recipe  # noqa: F401

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

# Runs the trainer in this process, but SIGKILLs itself when optimizer step KILL_AT is about to run,
# i.e. mid-run, after the checkpoint of an earlier step and with later steps still to do.
KILL_SCRIPT = """
import os, signal, sys
import attnkit.training.finetune as ft
real = ft.broadcast_step
def broadcast_or_die(model, step, total):
    if step == int(os.environ["KILL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(model, step, total)
ft.broadcast_step = broadcast_or_die
from attnkit.finetune import main
sys.exit(main(sys.argv[1:]))
"""


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def assert_same_weights(a: Path, b: Path, atol: float) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def finetune(args: list[str], extra_env: dict | None = None, script: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", script, *args] if script else [sys.executable, "-m", "attnkit.finetune", *args]
    return subprocess.run(cmd, env={**ENV, **(extra_env or {})}, capture_output=True, text=True, timeout=300)


def in_process(path, *overrides: str) -> None:
    """One process, in this interpreter (saves an interpreter start-up per run)."""
    from attnkit.training.finetune import run
    from attnkit.training.recipe import load_finetune_recipe

    run(load_finetune_recipe(path, list(overrides)))


def trained_changed(out: Path, start: Path) -> bool:
    before, after = weights(start), weights(out)
    return any(not torch.equal(before[k], after[k]) for k in after if k in before)


@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted_run(tiny, tmp_path):
    recipe = base_recipe(tmp_path, tiny["mla"], tiny["llama"], tiny["corpus"])
    recipe["checkpoint"] = {"every": 3, "keep": 2}
    # dropout makes the RNG state part of what must be restored
    recipe["train"].update(trainable="lora", lora={"r": 4, "dropout": 0.1, "target_modules": ["q_proj", "kv_b_proj"]})
    path = write_recipe(tmp_path / "r.yaml", **recipe)

    in_process(path, f"output_dir={tmp_path / 'whole'}", f"run_dir={tmp_path / 'whole.run'}")

    args = ["--config", str(path), f"output_dir={tmp_path / 'resumed'}", f"run_dir={tmp_path / 'resumed.run'}"]
    killed = finetune(args, {"KILL_AT": "7"}, KILL_SCRIPT)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (tmp_path / "resumed").exists()
    assert sorted(p.name for p in (tmp_path / "resumed.run" / "checkpoints").iterdir()) == ["step-000003", "step-000006"]
    in_process(*args[1:])
    assert "resume" in (tmp_path / "resumed.run" / "log.jsonl").read_text()

    assert trained_changed(tmp_path / "whole", tiny["mla"])
    assert_same_weights(tmp_path / "whole", tmp_path / "resumed", atol=1e-6)


@pytest.mark.slow
def test_two_processes_match_one_with_double_batch(tiny, tmp_path):
    recipe = base_recipe(tmp_path, tiny["mla"], tiny["llama"], tiny["corpus"])
    recipe["train"]["max_steps"] = 4
    recipe["loss"]["hidden_weight"] = 1.0  # the per-layer term averages like the others across processes
    recipe["data"]["val_tokens"] = 16  # one held-out row for two processes: both must still score it
    path = write_recipe(tmp_path / "r.yaml", **recipe)

    in_process(path, f"output_dir={tmp_path / 'one'}", "train.per_device_batch_size=4")
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
        "-m", "attnkit.finetune", "--config", str(path), f"output_dir={tmp_path / 'two'}", "train.per_device_batch_size=2",
    ]
    two = subprocess.run(launch, env={**ENV, "ACCELERATE_USE_CPU": "1"}, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    import json

    report = json.loads((tmp_path / "two" / "finetune_report.json").read_text())
    assert report["processes"] == 2
    assert report["tokens_seen"] == json.loads((tmp_path / "one" / "finetune_report.json").read_text())["tokens_seen"]
    assert trained_changed(tmp_path / "one", tiny["mla"])
    assert_same_weights(tmp_path / "one", tmp_path / "two", atol=2e-5)
    one_report = json.loads((tmp_path / "one" / "finetune_report.json").read_text())
    assert report["validation_text"]["rows"] == one_report["validation_text"]["rows"] == 1
    for when in ("eval_before", "eval_after"):
        assert report[when]["validation"]["loss"] == pytest.approx(one_report[when]["validation"]["loss"], abs=2e-5)
