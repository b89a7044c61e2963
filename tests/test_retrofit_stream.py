"""The retrofits stream one layer at a time (`converters/retrofit_stream.py`) and write exactly what
the whole model in memory would: the same statistics bit for bit, and the same tensors and config as
installing the modules on the loaded model and calling `save_pretrained`."""

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnkit.adapters.modeling_attnkit import CLASSES, install_retrofit
from attnkit.cli import main as cli_main
from attnkit.converters.calibration import calibrate
from attnkit.converters.common import calibration_tokens
from attnkit.converters.mla.source import open_source
from attnkit.converters.retrofit import EVAL_ROWS, _family_check
from attnkit.converters.retrofit_stream import calibration_pass, causal_mask, open_streams

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import calib_folder, save_model  # noqa: E402

KINDS = {"llama": {}, "mistral": {"sliding_window": 40}, "qwen2": {}, "mha": {}, "mqa": {}}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_causal_mask_is_sdpa_causal_within_the_window():
    assert causal_mask(8, None, "cpu") is None and causal_mask(8, 8, "cpu") is None
    full = causal_mask(5, None, "cpu", always=True)[0, 0]
    assert torch.equal(full, torch.ones(5, 5, dtype=torch.bool).tril())
    win = causal_mask(5, 2, "cpu")[0, 0]  # a query sees itself and the key before it
    assert win.sum(-1).tolist() == [1, 2, 2, 2, 2] and not win[4, 2]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_streamed_statistics_equal_the_whole_models_bit_for_bit(tmp_path, kind):
    """Layer by layer, batches of rows as the whole-model pass takes them: not one bit differs
    (Mistral's window is shorter than the rows, so its mask is the sliding one)."""
    src_path = save_model(tmp_path / "src", kind, max_position_embeddings=128, **KINDS[kind])
    rows = torch.randint(3, 100, (6, 64), generator=torch.Generator().manual_seed(1))
    model = AutoModelForCausalLM.from_pretrained(src_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    whole = calibrate(model, rows, torch.device("cpu"), tokens_per_batch=128)  # batches of 2 rows
    src = open_source(str(src_path), check=_family_check("dex", kind))
    calib, held = open_streams(src, rows, rows[:2], tmp_path)
    streamed = calibration_pass(src, calib, held, "cpu", tokens_per_batch=128)
    assert torch.equal(streamed["entropy"], whole["entropy"]) and torch.equal(streamed["head_rms"], whole["head_rms"])


def _args(**over) -> argparse.Namespace:
    base = dict(calib_seq_len=64, calib_tokens=384, seed=0)
    return argparse.Namespace(**{**base, **over})


@pytest.mark.parametrize("method,kind,extra", [("diff", "qwen2", []), ("titans", "llama", ["--window", "16"]),
                                               ("dex", "mistral", ["--heads", "0.5"])])
def test_streamed_output_equals_the_whole_model_saved(tmp_path, method, kind, extra):
    """What `save_pretrained` writes for the source loaded whole, the modules installed (their
    weights initialised from whole-model statistics): every tensor and config field."""
    src_path = save_model(tmp_path / "src", kind, dtype=torch.bfloat16, max_position_embeddings=128)
    calib = calib_folder(tmp_path / "calib")
    out = tmp_path / "out"
    assert cli_main(["convert", "--to", method, str(src_path), "-o", str(out), "--calib", str(calib),
                     "--calib-seq-len", "64", "--calib-tokens", "384", "--calib-dtype", "fp32", *extra]) == 0
    written = json.loads((out / "config.json").read_text())

    # the reference: the whole model in memory, as the retrofit was written before it streamed
    a = _args()
    rows, _, _ = calibration_tokens(AutoTokenizer.from_pretrained(src_path), str(calib), a.calib_seq_len, a.calib_tokens,
                                    EVAL_ROWS * a.calib_seq_len, a.seed)
    model = AutoModelForCausalLM.from_pretrained(src_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    stats = calibrate(model, rows, torch.device("cpu"))
    config_class, model_class = CLASSES[kind]
    model.config.__class__ = config_class
    model.config.attnkit = written["attnkit"]
    model.__class__ = model_class
    install_retrofit(model, model.config, kind)
    if method == "diff":
        from attnkit.converters.diff.convert import _init_norms

        for attn in (m for m in model.modules() if hasattr(m, "diff")):
            _init_norms(attn, stats)
    if method == "titans":
        from attnkit.converters.titans.convert import _init_memory

        for attn in (m for m in model.modules() if hasattr(m, "titans")):
            _init_memory(attn, stats)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "whole")
    ref, got = _tensors(tmp_path / "whole"), _tensors(out)
    assert sorted(ref) == sorted(got)
    assert all(ref[k].dtype == got[k].dtype and torch.equal(ref[k], got[k]) for k in ref), \
        [k for k in ref if not torch.equal(ref[k], got[k])]
    assert json.loads((tmp_path / "whole" / "config.json").read_text()) == written
    assert (tmp_path / "whole" / "generation_config.json").read_text() == (out / "generation_config.json").read_text()
