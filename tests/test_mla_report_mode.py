"""`convert --to mla --report final`: the same tensors as the per-step run, the written model's row
unchanged, the intermediate steps skipped (but a folded QK-norm step still measured)."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from attnkit.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import COMMON, save_model, tokenizer  # noqa: E402

FAST = ["--calib-tokens", "256", "--calib-seq-len", "32", "--eval-tokens", "128", "--kv-lora-rank", "17", "--rope-dim", "8"]


def _run(src: Path, out: Path, calib: Path, *extra: str) -> dict:
    assert main(["convert", "--to", "mla", str(src), "-o", str(out), "--calib", str(calib), *FAST, *extra]) == 0
    return json.loads((out / "attnkit_report.json").read_text())


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_final_report_same_tensors_and_written_model_row(tmp_path, calib, capsys):
    src = save_model(tmp_path / "src", "qwen2")  # biases: the engine form's refit and anchor run
    steps = _run(src, tmp_path / "steps", calib)
    final = _run(src, tmp_path / "final", calib, "--report", "final")
    assert "--report final" in capsys.readouterr().out
    a, b = _tensors(tmp_path / "steps"), _tensors(tmp_path / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [s["name"] for s in final["steps"]] == ["native"] and len(steps["steps"]) == 6
    assert final["steps"][0] == steps["steps"][-1] and final["ppl"] == steps["ppl"]
    assert final["settings"]["report"] == "final" and steps["settings"]["report"] == "steps"
    assert all(list(layer["attn_rel_err_mean"]) == ["native"] for layer in final["layers"])


def test_final_report_still_measures_a_folded_norm(tmp_path, calib):
    torch.manual_seed(0)
    cfg = Qwen3Config(**{**COMMON, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms that are not constant scales, so that the fold is lossy
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "src")
    tokenizer().save_pretrained(tmp_path / "src")
    report = _run(tmp_path / "src", tmp_path / "out", calib, "--format", "deepseek_v3", "--report", "final")
    assert [s["name"] for s in report["steps"]] == ["exact", "native"]
    assert report["qk_norm_fold"]["kl"] > 0
