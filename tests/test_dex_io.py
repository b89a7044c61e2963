"""Saving and loading DEX/DIFF models: Auto registration, fresh-process trust_remote_code load,
PEFT (LoRA + modules_to_save) and merge_and_unload, MLA + DEX."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from test_dex_models import calib, convert_cli, fresh_process_logits, retrofit_pair, save_tiny_model, set_step  # noqa: F401 (calib: fixture)
from transformers import AutoModelForCausalLM

import attnkit.adapters  # noqa: F401  (registers attnkit_* with the Auto classes)


def _adapt_randomly(model, seed: int) -> None:
    """Stand-in for a fine-tune: ramp fully on, new parameters moved away from their init."""
    gen = torch.Generator().manual_seed(seed)
    set_step(model, 10, 10)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".dex." in name or ".diff" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)


@pytest.mark.slow
@pytest.mark.parametrize("family, method", [("llama", "dex"), ("deepseek_v3", "diff")])
def test_save_and_fresh_process_load(tmp_path, calib, family, method):
    src = save_tiny_model(tmp_path / "src", family)
    out = tmp_path / "converted"
    assert convert_cli(method, src, out, calib) == 0
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    source = AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        source_logits = source(input_ids=ids).logits
    # adapt in this process (registered classes, no remote code), save
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__.startswith("Attnkit")
    _adapt_randomly(model, 1)
    with torch.no_grad():
        adapted_logits = model(input_ids=ids).logits
    assert not torch.allclose(adapted_logits, source_logits)
    model.save_pretrained(tmp_path / "adapted")
    config = json.loads((tmp_path / "adapted" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"].startswith("modeling_attnkit.")
    # both folders, loaded in a fresh process with trust_remote_code: identical logits
    as_written, adapted = fresh_process_logits([out, tmp_path / "adapted"], ids, tmp_path)
    assert torch.equal(as_written, source_logits)
    assert torch.equal(adapted, adapted_logits)


@pytest.mark.parametrize("method, to_save", [("dex", ["dex"]), ("diff", ["diff", "diff_q_proj"])])
def test_peft_trains_new_modules_and_merge_keeps_them(method, to_save):
    from peft import LoraConfig, get_peft_model

    _, model = retrofit_pair("qwen2", method, 4)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], modules_to_save=to_save)
    peft_model = get_peft_model(model, lora)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable)
    new_names = [n for n in trainable if ".dex." in n or ".diff" in n]
    assert new_names and all("modules_to_save" in n for n in new_names)
    assert not any("diff_q_proj.base_layer" in n or "lora" in n and "diff" in n for n in trainable)

    # one optimiser step with the schedule on, as the trainer would run it
    set_step(peft_model, 5, 10)
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.torch.no_grad():
        for n, p in peft_model.named_parameters():  # LoRA B starts at 0: move it so merging matters
            if "lora_B" in n:
                p.add_(0.05)
        peft_model.eval()
        before = peft_model(input_ids=ids).logits
        merged = peft_model.merge_and_unload()
        after = merged(input_ids=ids).logits
    assert torch.allclose(before, after, atol=1e-5)
    trained = dict(merged.named_parameters())
    module = merged.model.layers[0].self_attn
    assert type(module.dex if method == "dex" else module.diff).__name__ in ("DexHeadMix", "DiffCombine")
    key = "model.layers.0.self_attn.dex.f_d.weight" if method == "dex" else "model.layers.0.self_attn.diff_q_proj.weight"
    assert trained[key].abs().sum() > 0  # the trained copy (init was 0) is what merge kept


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("attnkit.converters.mla.convert") is None, reason="MLA pipeline not available")
def test_mla_plus_dex_composes(tmp_path, calib):
    src = save_tiny_model(tmp_path / "src", "llama")
    out = tmp_path / "mla-dex"
    assert convert_cli("mla+dex", src, out, calib, "--heads", "all") == 0
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["method"] == "mla+dex" and report["source"]["model_type"] == "llama"
    assert report["steps"][-1]["exact"] is True and len(report["steps"]) > 1
    assert report["load"]["trust_remote_code"] is True
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "attnkit_deepseek_v3"
    assert config["attnkit"]["selected_heads"] == [[0, 1, 2, 3]] * 2
    assert not list(tmp_path.glob(".mla-dex*"))  # the MLA scratch folder is gone
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    mla = {k: v for k, v in report["mla"].items()}
    assert mla["method"] == "mla"
    ids = torch.randint(0, 300, (1, 7))
    cache = model(input_ids=ids, use_cache=True).past_key_values
    assert cache is not None  # the latent cache of the MLA model, untouched by DEX
