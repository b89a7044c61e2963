"""`attnkit convert --to mla+dex`: its report speaks of the user's model, and its MLA scratch folder
is one that the next run cleans up after a SIGKILL (tiny random Llama stored in bf16, as real ones are)."""

from __future__ import annotations

import importlib.util
import io
import json
import signal
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from test_dex_models import convert_cli, tiny_config, tiny_tokenizer, write_calib

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("attnkit.converters.mla.convert") is None, reason="MLA pipeline not available"),
]

# A `--to mla+dex` run that is SIGKILLed inside its MLA step, after the step wrote into its scratch folder.
KILLED_RUN = """
import os, signal, sys
from pathlib import Path
import attnkit.converters.dex.convert as dex

def write_then_die(args):
    Path(args.out).mkdir(parents=True)
    (Path(args.out) / "config.json").write_text("{}")
    os.kill(os.getpid(), signal.SIGKILL)

dex.convert_mla = write_then_die
from attnkit.cli import main
src, out, calib = sys.argv[1:]
main(["convert", "--to", "mla+dex", src, "-o", out, "--calib", calib, "--calib-tokens", "1024",
      "--calib-seq-len", "32", "--heads", "all"])
"""


def _bf16_llama(folder: Path) -> Path:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).to(torch.bfloat16).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mla_dex")
    calib = write_calib(root / "calib")
    src = _bf16_llama(root / "src")
    parent = root / "outs"
    parent.mkdir()
    killed = subprocess.run([sys.executable, "-c", KILLED_RUN, str(src), str(parent / "killed"), str(calib)],
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    leftovers = sorted(p.name for p in parent.iterdir())
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert convert_cli("mla+dex", src, parent / "mla-dex", calib, "--heads", "all", "--kv-lora-rank", "12", "--rope-dim", "4") == 0
    # plain DEX on the same source and calibration rows: its "before" is the source's own perplexity
    with redirect_stdout(io.StringIO()):
        assert convert_cli("dex", src, root / "dex", calib, "--heads", "all") == 0
    return {
        "leftovers": leftovers,
        "after_next_run": sorted(p.name for p in parent.iterdir()),
        "printed": printed.getvalue(),
        "report": json.loads((parent / "mla-dex" / "attnkit_report.json").read_text()),
        "dex": json.loads((root / "dex" / "attnkit_report.json").read_text()),
    }


def test_a_killed_runs_mla_scratch_is_removed_by_the_next_run(runs):
    assert runs["leftovers"], "the killed run should have left its scratch folder"
    # its scratch folder, and its output claim (a lock file the kernel freed with the process)
    assert all(".killed.attnkit-tmp-" in name or name == ".killed.attnkit-lock" for name in runs["leftovers"]), runs["leftovers"]
    assert any(".killed.attnkit-tmp-" in name for name in runs["leftovers"])
    assert runs["after_next_run"] == ["mla-dex"]


def test_kv_fraction_is_of_the_original_model(runs):
    report = runs["report"]
    kv, mla = report["kv_cache_bytes_per_token"], report["mla"]
    # the bf16 Llama: 2 layers x (K + V) x 2 KV heads x head_dim 8 x 2 bytes
    assert kv["before"] == 2 * 2 * 2 * 8 * 2 == mla["kv_cache_bytes_per_token"]["before"]
    assert kv["after"] == mla["kv_cache_bytes_per_token"]["after"] < kv["before"]  # counted in bf16 too
    assert report["kv_cache_fraction"] == pytest.approx(mla["kv_cache_fraction"])
    assert kv["dtype"] == "bf16"
    assert f"KV cache: {kv['before']} -> {kv['after']} B/token (bf16), {100 * mla['kv_cache_fraction']:.1f} % of the source" in runs["printed"]


def test_ppl_before_is_the_original_models(runs):
    report, dex = runs["report"], runs["dex"]
    assert report["ppl"]["split"] == dex["ppl"]["split"]
    assert report["ppl"]["before"] == pytest.approx(dex["ppl"]["before"], rel=1e-6)
    assert report["ppl"]["after"] != pytest.approx(report["ppl"]["before"], rel=1e-6)  # MLA is lossy here
    assert f") {report['ppl']['before']:.3f} -> {report['ppl']['after']:.3f} (the change is the MLA step's)" in runs["printed"]
    assert "logits unchanged by this step" in runs["printed"] and "exact: True" not in runs["printed"]


def test_load_claims_only_what_holds_for_the_remote_code_output(runs):
    load = runs["report"]["load"]
    assert load["trust_remote_code"] is True
    assert "min_transformers" not in load and "needs" not in load  # MLA-only notes (4.x, engines)
