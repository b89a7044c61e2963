"""recipes/heal-titans.yaml and lora-titans.yaml end to end on a tiny converted model: only the memory
modules (and, with LoRA, the merged attention projections) train, the gate ramps open, the result
reloads with its remote code and still decodes like its full forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_finetune_fixtures import tiny  # noqa: F401  (fixture)
from transformers import AutoModelForCausalLM

from attnkit.cli import main as cli_main
from attnkit.training.finetune import run
from attnkit.training.recipe import load_finetune_recipe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@pytest.mark.parametrize("recipe, also_changed", [("heal-titans.yaml", ()),
                                                  ("lora-titans.yaml", ("q_proj", "k_proj", "v_proj", "o_proj"))])
def test_heal_titans_trains_the_memory_and_opens_the_gate(tiny, tmp_path, recipe, also_changed):  # noqa: F811
    converted, out = tmp_path / "titans", tmp_path / "out"
    assert cli_main(["convert", "--to", "titans", str(tiny["llama"]), "-o", str(converted), "--window", "8",
                     "--chunk", "4", "--calib", str(tiny["corpus"]), "--calib-seq-len", "16", "--calib-tokens", "256"]) == 0
    overrides = [
        f"model={converted}", f"output_dir={out}", f"data.source={tiny['corpus']}", "data.seq_len=24",
        "data.tokens=768", "data.val_tokens=96", "train.per_device_batch_size=4", "eval.tasks=null",
        "checkpoint.every=0", "log.tensorboard=false", "train.lr=1e-2",
    ]
    report = run(load_finetune_recipe(RECIPES / recipe, overrides))
    assert report["teacher"] and report["load"] == {"trust_remote_code": True}
    assert (out / "titans.py").is_file() and "auto_map" in json.loads((out / "config.json").read_text())
    before, after = load_file(str(converted / "model.safetensors")), load_file(str(out / "model.safetensors"))
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert changed and all(".titans." in k or k.split(".")[-2] in also_changed for k in changed), changed
    assert all(any(k.endswith(f"self_attn.{name}.weight") for k in changed) for name in also_changed)
    assert any(k.endswith("titans.mix.weight") for k in changed) and any(".initial." in k for k in changed)
    assert all(float(before[k]) == 0.0 for k in before if k.endswith("titans.ramp"))
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert all(float(m.ramp) == 1.0 for m in model.modules() if hasattr(m, "mix"))
    assert_decodes_like_full_forward(model)


def test_heal_slots_with_the_gate_shut_trains_only_the_attention(tiny, tmp_path):  # noqa: F811
    """recipes/lora-titans-slots.yaml on a `--sparse-slots --memory-gate shut` conversion: the merged q/k/v/o
    change, no memory weight does, the ramp stays 0 (the memory only chooses the slots), and the result
    decodes like its full forward with its remote code."""
    converted, out = tmp_path / "titans", tmp_path / "out"
    assert cli_main(["convert", "--to", "titans", str(tiny["llama"]), "-o", str(converted), "--window", "8",
                     "--chunk", "4", "--sparse-slots", "3", "--memory-gate", "shut", "--calib", str(tiny["corpus"]),
                     "--calib-seq-len", "16", "--calib-tokens", "256"]) == 0
    overrides = [
        f"model={converted}", f"output_dir={out}", f"data.source={tiny['corpus']}", "data.seq_len=24",
        "data.tokens=768", "data.val_tokens=96", "train.per_device_batch_size=4", "eval.tasks=null",
        "checkpoint.every=0", "log.tensorboard=false", "train.lr=1e-2", "data.needles.spacing=[4,8]",
        "data.needles.distance=[10,14]",
    ]
    run(load_finetune_recipe(RECIPES / "lora-titans-slots.yaml", overrides))
    before, after = load_file(str(converted / "model.safetensors")), load_file(str(out / "model.safetensors"))
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert changed and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") and ".titans." not in k
                           for k in changed), changed
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert model.config.attnkit["memory_mix"] is False and model.config.attnkit["sparse_slots"] == 3
    assert all(float(m.ramp) == 0.0 for m in model.modules() if hasattr(m, "mix"))
    assert_decodes_like_full_forward(model)


def assert_decodes_like_full_forward(model) -> None:
    """Prefill 5 tokens, decode 16 one at a time with the cache: the logits of one forward without it."""
    ids = torch.randint(0, model.config.vocab_size, (2, 21))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        step = model(input_ids=ids[:, :5], use_cache=True)
        logits, cache = [step.logits], step.cache
        for t in range(5, ids.shape[1]):
            step = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
            logits.append(step.logits)
    torch.testing.assert_close(torch.cat(logits, dim=1), full, rtol=1e-5, atol=1e-5)
