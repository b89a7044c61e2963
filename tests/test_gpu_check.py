"""benchmarks/gpu_check.py, the prepared run for a lent GPU machine: its cheap parts checked here, so that the
one short device run does not fail on plumbing. (The whole script was run on a CPU with `--device cpu --layers 2`.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import BENCHMARKS, load_benchmark


def test_environment_lists_versions_and_nothing_missing_here():
    gpu_check = load_benchmark("gpu_check.py", "gpu_check_bench")
    env = gpu_check.environment()
    assert env["missing"] == []  # this machine has what attnkit needs
    assert env["versions"]["torch"] and env["versions"]["accelerate"]
    assert isinstance(env["gpus"], list)


def test_a_cuda_run_without_a_gpu_stops_after_the_environment(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "torch sees no GPU" in proc.stderr
    import json

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report) == ["command", "environment"]  # nothing converted or launched
