"""The healing fine-tune: recipe schema, schedules, losses, trainable sets, export and refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from test_finetune_fixtures import base_recipe, build_tokenizer, save_llama, tiny, write_corpus, write_recipe  # noqa: F401

from attnkit.cli import main as cli_main
from attnkit.errors import AttnkitError
from attnkit.training.losses import distill_kl, heal_loss, hidden_mse, next_token_ce
from attnkit.training.recipe import load_finetune_recipe
from attnkit.training.schedules import broadcast_step, lr_multiplier


def train(path, *overrides):
    from attnkit.training.finetune import run

    return run(load_finetune_recipe(path, list(overrides)))


# ------------------------------------------------------------------ recipe schema


def test_overrides_and_types(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", model="m", output_dir="o", teacher="t", train={"patterns": ["q_proj"]})
    r = load_finetune_recipe(path, ["train.lr=1e-4", "data.seq_len=64", "train.lora.target_modules=[a,b]", "eval.tasks=attnkit-core"])
    assert r.train.lr == 1e-4 and r.data.seq_len == 64 and r.train.lora.target_modules == ["a", "b"]
    assert r.eval.tasks == "attnkit-core" and r.resolved_run_dir.name == "o.run"
    assert r.fingerprint() != load_finetune_recipe(path, ["train.lr=2e-4"]).fingerprint()
    assert load_finetune_recipe(path).fingerprint() == load_finetune_recipe(path, ["eval.every=5"]).fingerprint()  # eval does not change training


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lerning_rate=1", "train.lerning_rate"),
        ("train.lr=fast", "train.lr"),
        ("data.seq_len=1.5", "data.seq_len"),
        ("train.lora.merge=maybe", "train.lora.merge"),
        ("data=3", "data"),
        ("train.schedule=linear", "train.schedule"),
        ("loss.temperature=0", "loss.temperature"),
        ("teacher=null", "teacher"),
        ("train.rest_lr=-1e-5", "train.rest_lr"),
        ("train.frozen_dtype=bf16", "train.frozen_dtype"),
    ],
)
def test_bad_recipe_names_the_key(tmp_path, override, key):
    path = write_recipe(tmp_path / "r.yaml", model="m", output_dir="o", teacher="t", train={"patterns": ["q"]})
    with pytest.raises(AttnkitError, match=f"recipe key {key}[:( ]"):
        load_finetune_recipe(path, [override])


def test_cli_bad_recipe_is_one_line_exit_2(tmp_path, capsys):
    path = write_recipe(tmp_path / "r.yaml", model="m", output_dir="o", batch=3)
    assert cli_main(["finetune", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnkit: error: recipe key batch: unknown key") and "\n" not in err


def test_shipped_recipes_parse():
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "recipes"
    names = {p.name for p in folder.glob("*.yaml")}
    assert {"heal-mla.yaml", "heal-dex.yaml", "heal-diff.yaml", "lora-mla.yaml", "heal-gqa.yaml"} <= names
    for name in ("heal-mla.yaml", "heal-dex.yaml", "heal-diff.yaml", "lora-mla.yaml", "heal-gqa.yaml"):
        load_finetune_recipe(folder / name)


# ------------------------------------------------------------------ schedules and losses


@settings(max_examples=25, deadline=None)
@given(total=st.integers(2, 300), warm=st.integers(0, 20), kind=st.sampled_from(["cosine", "wsd", "constant"]))
def test_lr_multiplier_shape(total, warm, kind):
    m = [lr_multiplier(s, total, warm, kind, 0.1, 0.25) for s in range(total)]
    assert all(0 < x <= 1 + 1e-9 for x in m) and all(x >= 0.1 - 1e-9 for x in m[warm:])
    assert all(a <= b + 1e-12 for a, b in zip(m[:warm], m[1:warm]))  # warmup rises
    after = m[warm:]
    assert all(a >= b - 1e-12 for a, b in zip(after, after[1:]))  # then never rises
    if warm < total - 1 and kind != "constant":
        assert lr_multiplier(total, total, warm, kind, 0.1, 0.25) == pytest.approx(0.1)
    if kind == "wsd" and warm < total * 0.5:
        assert m[warm] == 1.0


def test_broadcast_step_reaches_every_module():
    seen = []

    class Annealed(torch.nn.Module):
        def attnkit_set_step(self, step, total):
            seen.append((step, total))

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Annealed(), torch.nn.Sequential(Annealed()))
    assert broadcast_step(model, 3, 10) == 2 and seen == [(3, 10), (3, 10)]


@settings(max_examples=10, deadline=None)
@given(b=st.integers(1, 3), length=st.integers(2, 6), vocab=st.integers(3, 11), temp=st.floats(0.5, 4.0))
def test_distill_kl_matches_definition(b, length, vocab, temp):
    torch.manual_seed(b * 100 + length)
    s, t = torch.randn(b, length, vocab), torch.randn(b, length, vocab)
    p, log_q = F.softmax(t / temp, -1), F.log_softmax(s / temp, -1)
    manual = (p * (p.log() - log_q)).sum(-1).mean() * temp**2
    torch.testing.assert_close(distill_kl(s, t, temp), manual, rtol=1e-5, atol=1e-6)
    assert float(distill_kl(t, t, temp)) == pytest.approx(0.0, abs=1e-6)


def test_ce_matches_transformers_loss(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["llama"])
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    out = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(next_token_ce(out.logits, ids), out.loss, rtol=1e-6, atol=1e-6)
    total, parts = heal_loss(out.logits, ids, out.logits, ce_weight=0.5, kl_weight=2.0, temperature=1.0)
    assert parts["kl"] == pytest.approx(0.0, abs=1e-6) and float(total) == pytest.approx(0.5 * parts["ce"], rel=1e-6)


@settings(max_examples=10, deadline=None)
@given(layers=st.integers(1, 4), b=st.integers(1, 2), length=st.integers(1, 5), dim=st.integers(2, 9))
def test_hidden_mse_matches_definition(layers, b, length, dim):
    torch.manual_seed(layers * 1000 + b * 100 + length * 10 + dim)
    t = [torch.randn(b, length, dim) for _ in range(layers)]
    s = [x + 0.1 * torch.randn_like(x) for x in t]
    manual = sum(((x - y) ** 2).sum(-1).div((y**2).sum(-1)).mean() for x, y in zip(s, t)) / layers
    torch.testing.assert_close(hidden_mse(s, t), manual, rtol=1e-5, atol=1e-7)
    assert float(hidden_mse(t, t)) == 0.0
    with pytest.raises(ValueError, match="depth"):
        hidden_mse(s[:-1] + [s[-1], s[-1]], t)


def test_hidden_loss_is_zero_for_the_teacher_itself_and_trains_the_student(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["llama"])
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    out = model(input_ids=ids, output_hidden_states=True)
    same = (out.hidden_states[1:], out.hidden_states[1:])
    total, parts = heal_loss(out.logits, ids, out.logits, 0.0, 1.0, 1.0, hidden_weight=1.0, hidden=same)
    assert parts["hidden"] == 0.0 and float(total) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="hidden states"):
        heal_loss(out.logits, ids, out.logits, 0.0, 1.0, 1.0, hidden_weight=1.0)
    student = AutoModelForCausalLM.from_pretrained(tiny["llama"])
    with torch.no_grad():
        student.model.layers[0].self_attn.v_proj.weight.mul_(1.5)  # break layer 0's attention only
    s_out = student(input_ids=ids, output_hidden_states=True)
    _, parts = heal_loss(s_out.logits, ids, out.logits, 0.0, 0.0, 1.0, hidden_weight=1.0,
                         hidden=(s_out.hidden_states[1:], [h.detach() for h in out.hidden_states[1:]]))
    assert parts["hidden"] > 0


# ------------------------------------------------------------------ end to end


def test_new_params_heal_trains_only_patterns_and_reloads(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    recipe = base_recipe(tmp_path, tiny["mla"], tiny["llama"], tiny["corpus"])
    recipe["train"].update(trainable="new", patterns=[r"kv_b_proj", r"kv_a_layernorm"], schedule="wsd")
    recipe["eval"] = {"every": 4}
    report = train(write_recipe(tmp_path / "r.yaml", **recipe))
    out = tmp_path / "out"
    before, after = load_file(str(tiny["mla"] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert changed == {"model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.self_attn.kv_a_layernorm.weight"}

    saved = json.loads((out / "finetune_report.json").read_text())
    assert saved["tokens_seen"] == 12 * 4 * 16 == report["tokens_seen"] and saved["steps"] == 12
    assert saved["load"] == {"trust_remote_code": False}
    for key in ("teacher", "teacher_path"):  # no absolute path in a report (push uploads it): by name or relative
        assert not Path(saved[key]).is_absolute() and Path(saved[key]).name == tiny["llama"].name
    assert len(saved["loss_curve"]) == 12 and saved["trainable"].startswith("new: ")
    assert saved["eval_after"]["validation"]["loss"] < saved["eval_before"]["validation"]["loss"]
    assert [p[0] for p in saved["eval_curve"]] == [4, 8, 12]
    assert (out / "README.md").is_file() and (out / "tokenizer.json").is_file()
    from attnkit.training.plot import plot, retention_curve

    curve = retention_curve(saved)
    assert [x for x, _ in curve] == [0, 256, 512, 768] and curve[-1][1] > curve[0][1]
    assert plot([out], ["new"], tmp_path / "r.png").stat().st_size > 1000

    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    val = torch.randint(0, model.config.vocab_size, (1, 12))
    reference = AutoModelForCausalLM.from_pretrained(tiny["mla"])
    reference.load_state_dict(after, strict=False)
    torch.testing.assert_close(model(val).logits, reference(val).logits, rtol=0, atol=0)


def test_rest_lr_applies_only_to_a_partial_trainable_set(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", model="m", output_dir="o", teacher="t", train={"patterns": ["q"]})
    assert load_finetune_recipe(path, ["train.rest_lr=1e-5"]).train.rest_lr == 1e-5
    with pytest.raises(AttnkitError, match="recipe key train.rest_lr: applies to trainable new or attention"):
        load_finetune_recipe(path, ["train.trainable=full", "train.rest_lr=1e-5"])


def test_rest_lr_trains_everything_in_two_groups(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from attnkit.training.trainable import param_groups, select_trainable

    model = AutoModelForCausalLM.from_pretrained(tiny["mla"])
    chosen = select_trainable(model, "new", [r"kv_b_proj"])
    frozen = param_groups(model, chosen, 1e-3, 0.0)
    assert [g["lr"] for g in frozen] == [1e-3] and sum(p.requires_grad for p in model.parameters()) == len(chosen)
    groups = param_groups(model, chosen, 1e-3, 1e-5)
    assert [g["lr"] for g in groups] == [1e-3, 1e-5] and all(p.requires_grad for p in model.parameters())
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))  # tied weights once

    recipe = base_recipe(tmp_path, tiny["mla"], tiny["llama"], tiny["corpus"])
    recipe["train"].update(trainable="new", patterns=[r"kv_b_proj"], rest_lr=1e-4)
    train(write_recipe(tmp_path / "r.yaml", **recipe))
    before, after = load_file(str(tiny["mla"] / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert not {k for k in after if torch.equal(before[k], after[k])}


def test_lora_merge_gives_plain_checkpoint(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    recipe = base_recipe(tmp_path, tiny["mla"], tiny["llama"], tiny["corpus"])  # teacher: quality reference only
    recipe["train"].update(
        trainable="lora", max_steps=3, lora={"r": 4, "target_modules": ["q_proj", "kv_b_proj"], "modules_to_save": ["kv_a_layernorm"]}
    )
    recipe["loss"] = {"ce_weight": 1.0, "kl_weight": 0.0}
    report = train(write_recipe(tmp_path / "r.yaml", **recipe))
    assert report["eval_teacher"]["validation"]["loss"] > 0
    assert '"kl"' not in (tmp_path / "out.run" / "log.jsonl").read_text()  # no distillation term
    out = tmp_path / "out"
    keys = set(load_file(str(out / "model.safetensors")))
    assert keys == set(load_file(str(tiny["mla"] / "model.safetensors")))  # no lora_A / modules_to_save copies
    assert "lora" in json.loads((out / "finetune_report.json").read_text())["trainable"]
    AutoModelForCausalLM.from_pretrained(out)


# ------------------------------------------------------------------ refusals


def run_cli(path, *overrides):
    return cli_main(["finetune", "--config", str(path), *overrides])


def test_teacher_with_other_tokenizer_is_refused(tiny, tmp_path, capsys):
    other = build_tokenizer(write_corpus(tmp_path / "c.jsonl", seed=5), vocab_size=280)
    teacher = save_llama(tmp_path / "other", other)
    path = write_recipe(tmp_path / "r.yaml", **base_recipe(tmp_path, tiny["mla"], teacher, tiny["corpus"]))
    assert run_cli(path) == 2
    assert "different tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.run").exists()


def test_teacher_with_the_students_own_weights_is_refused_unless_asked(tiny, tmp_path, capsys):
    path = write_recipe(tmp_path / "r.yaml", **base_recipe(tmp_path, tiny["mla"], tiny["mla"], tiny["corpus"]))
    assert run_cli(path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "student's own weights" in err[0] and "teacher_is_student_ok" in err[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.run").exists()


def test_lm_loss_plus_hidden_term_without_kl_trains(tiny, tmp_path):
    """The heal-mla default: CE + hidden, no KL (the teacher runs without its LM head)."""
    recipe = base_recipe(tmp_path, tiny["mla"], tiny["llama"], tiny["corpus"])
    recipe["loss"] = {"ce_weight": 1.0, "kl_weight": 0.0, "hidden_weight": 1.0}
    train(write_recipe(tmp_path / "r.yaml", **recipe))
    steps = [json.loads(line) for line in (tmp_path / "out.run" / "log.jsonl").read_text().splitlines()]
    steps = [e for e in steps if "hidden" in e]
    assert len(steps) == 12 and all("ce" in e and "kl" not in e for e in steps)
    assert steps[-1]["hidden"] < steps[0]["hidden"]
    assert all(e["loss"] == pytest.approx(e["ce"] + e["hidden"], rel=1e-5) for e in steps)


def test_hidden_loss_with_a_teacher_of_other_depth_is_refused(tiny, tmp_path, capsys):
    teacher = save_llama(tmp_path / "deeper", tiny["tokenizer"], layers=2)
    recipe = base_recipe(tmp_path, tiny["mla"], teacher, tiny["corpus"])
    recipe["loss"]["hidden_weight"] = 1.0
    capsys.readouterr()  # drop save_llama's progress bar
    assert run_cli(write_recipe(tmp_path / "r.yaml", **recipe)) == 2
    err = capsys.readouterr().err
    assert "num_hidden_layers 2, the student 1" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.run").exists()


def test_dataset_too_small_is_refused(tiny, tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("def f(x):\n    return x + 1\n" * 3)
    recipe = base_recipe(tmp_path, tiny["mla"], tiny["llama"], small)
    recipe["data"]["val_tokens"] = 16
    assert run_cli(write_recipe(tmp_path / "r.yaml", **recipe)) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("attnkit: error: ") and "fewer than one batch" in last and "Traceback" not in err
    assert not (tmp_path / "out.run").exists()


def test_checkpoint_folder_of_another_run_is_refused_untouched(tiny, tmp_path, capsys):
    recipe = base_recipe(tmp_path, tiny["mla"], tiny["llama"], tiny["corpus"])
    recipe["train"]["max_steps"] = 3
    recipe["checkpoint"] = {"every": 1, "keep": 5}
    path = write_recipe(tmp_path / "r.yaml", **recipe)
    train(path, f"output_dir={tmp_path / 'first'}", f"run_dir={tmp_path / 'shared.run'}")
    ckpts = tmp_path / "shared.run" / "checkpoints"
    snapshot = {p: p.stat().st_mtime_ns for p in ckpts.rglob("*")}
    assert len(list(ckpts.iterdir())) == 2  # steps 1 and 2 (the last step is the exported model)

    assert run_cli(path, f"output_dir={tmp_path / 'second'}", f"run_dir={tmp_path / 'shared.run'}", "train.lr=0.5") == 2
    assert "different run" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in ckpts.rglob("*")} == snapshot
    assert not (tmp_path / "second").exists()

    assert run_cli(path, f"output_dir={tmp_path / 'first'}") == 2  # non-empty output without force
    assert "not empty" in capsys.readouterr().err


def test_diff_retrofit_heals_with_remote_code_and_step_schedule(tiny, tmp_path):
    """A DIFF retrofit (auto_map + modeling code) heals from `teacher: source` and reloads in kind."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    assert cli_main(["convert", "--to", "diff", str(tiny["llama"]), "-o", str(tmp_path / "diff")]) == 0
    recipe_file = Path(__file__).resolve().parent.parent / "recipes" / "heal-diff.yaml"
    overrides = [
        f"model={tmp_path / 'diff'}", f"output_dir={tmp_path / 'out'}", f"data.source={tiny['corpus']}",
        "data.seq_len=16", "data.tokens=512", "data.val_tokens=64", "train.per_device_batch_size=4",
        "eval.tasks=null", "checkpoint.every=0", "log.tensorboard=false", "train.lr=1e-2",
    ]
    report = train(recipe_file, *overrides)
    out = tmp_path / "out"
    assert report["teacher"] and report["load"] == {"trust_remote_code": True}
    assert (out / "modeling_attnkit.py").is_file() and "auto_map" in json.loads((out / "config.json").read_text())
    before, after = load_file(str(tmp_path / "diff" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert changed and all(".diff" in k for k in changed), changed
    ramp_keys = [k for k in before if k.endswith(".ramp")]
    assert ramp_keys and all(float(before[k]) == 0.0 for k in ramp_keys)  # the conversion starts un-annealed
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    ramps = [float(m.ramp) for m in model.modules() if hasattr(m, "attnkit_set_step")]
    assert ramps and all(r == 1.0 for r in ramps)  # broadcast_step drove the annealing to its end


def test_missing_tensorboard_degrades_with_a_note(tmp_path, monkeypatch):
    import accelerate.utils

    from attnkit.training.finetune import make_accelerator
    from attnkit.training.recipe import Recipe

    monkeypatch.setattr(accelerate.utils, "is_tensorboard_available", lambda: False)
    accelerator, note = make_accelerator(Recipe(model="m", output_dir=str(tmp_path / "o")))
    assert not accelerator.log_with and "pip install tensorboard" in note


def test_constant_latent_channel_is_protected(tiny):
    """The converter's constant latent channel (zero weight row, large bias) gets zero gradients."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from attnkit.training.trainable import apply_lora, protect_constant_channels

    config = AutoConfig.from_pretrained(tiny["mla"])
    config.attention_bias = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    attn = model.model.layers[0].self_attn
    rank = config.kv_lora_rank
    with torch.no_grad():
        attn.kv_a_proj_with_mqa.weight[rank - 1].zero_()
        attn.kv_a_proj_with_mqa.bias[rank - 1] = 1.0e5
    assert protect_constant_channels(model) == 1
    ids = torch.randint(0, config.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert attn.kv_b_proj.weight.grad[:, rank - 1].abs().max() == 0
    assert attn.kv_b_proj.weight.grad[:, : rank - 1].abs().max() > 0
    assert attn.kv_a_proj_with_mqa.weight.grad[rank - 1].abs().max() == 0
    assert attn.kv_a_layernorm.weight.grad[rank - 1] == 0 and attn.kv_a_layernorm.weight.grad[0] != 0

    lora = apply_lora(model, type("L", (), {"r": 2, "alpha": 4, "dropout": 0.0, "target_modules": ["kv_b_proj", "kv_a_proj_with_mqa"], "modules_to_save": []})())
    assert protect_constant_channels(lora) == 1
    kv_b = lora.base_model.model.model.layers[0].self_attn.kv_b_proj
    assert kv_b.lora_A["default"].weight[:, rank - 1].abs().max() == 0  # A never reads the constant
    torch.nn.init.normal_(kv_b.lora_B["default"].weight)  # B starts at 0, which would hide A's gradient
    lora(input_ids=ids, labels=ids).loss.backward()
    lora_a = kv_b.lora_A["default"].weight
    assert lora_a.grad[:, rank - 1].abs().max() == 0 and lora_a.grad[:, 0].abs().max() > 0
    lora_b = lora.base_model.model.model.layers[0].self_attn.kv_a_proj_with_mqa.lora_B["default"].weight
    assert lora_b.grad[rank - 1].abs().max() == 0 and lora_b.grad[0].abs().max() > 0


def test_constant_channels_read_from_the_checkpoint_match_the_loaded_model(tiny, tmp_path):
    """Under FSDP the student is built on the meta device and its constant channels are read from the
    checkpoint (`sharded_load.empty_student`): the same channels as from the loaded model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from attnkit.training import sharded_load
    from attnkit.training.trainable import constant_channel_map

    config = AutoConfig.from_pretrained(tiny["mla"])
    config.attention_bias, config.num_hidden_layers, config.first_k_dense_replace = True, 2, 2  # dense, as converted
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer, channel in ((0, 3), (1, 0), (1, 5)):
            proj = model.model.layers[layer].self_attn.kv_a_proj_with_mqa
            proj.weight[channel].zero_()
            proj.bias[channel] = 7.0
        model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight[1].zero_()  # zero row, zero bias: not constant
        model.model.layers[0].self_attn.kv_a_proj_with_mqa.bias[1] = 0.0
    model.save_pretrained(tmp_path / "m")
    expected = {"model.layers.0.self_attn": [3], "model.layers.1.self_attn": [0, 5]}
    assert constant_channel_map(model) == expected
    empty, channels = sharded_load.empty_student(tmp_path / "m", False)
    assert channels == expected and all(p.is_meta for p in empty.parameters())


def test_student_shards_stay_on_the_cpu_under_parameter_offload():
    """With `fsdp_offload_params: true` FSDP2 keeps the shards on the CPU: the student's are filled there."""
    import types

    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from attnkit.training.sharded_load import shard_device

    def accelerator(offload):
        plugin = types.SimpleNamespace(cpu_offload=offload)
        return types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), device=torch.device("meta"))

    assert shard_device(accelerator(CPUOffloadPolicy())) == torch.device("cpu")
    assert shard_device(accelerator(OffloadPolicy())) == torch.device("meta")  # no offload: the process's device


def test_position_ppl_scores_every_token_once_like_lm_eval(tiny):
    """position_ppl's buckets partition exactly the tokens lm-eval's rolling windows score."""
    from transformers import AutoModelForCausalLM

    from attnkit.training.position_ppl import bucket_nll, windows

    tokens = list(range(3, 3 + 70))
    wins = windows(tokens, 0, 32)
    assert sum(n for _, n in wins) == len(tokens) and all(len(t) <= 33 for t, _ in wins)
    assert [t[-n:] for t, n in wins] == [tokens[i : i + 32] for i in range(0, 64, 32)] + [tokens[64:]]
    model = AutoModelForCausalLM.from_pretrained(tiny["llama"]).eval()
    acc = bucket_nll(model, tokens, 0, 32, buckets=((0, 8), (8, 32)))
    assert int(acc[:, 1].sum()) == len(tokens)
    direct = 0.0
    for t, n in wins:
        logits = model(input_ids=torch.tensor([t[:-1]])).logits[0]
        direct += float(F.cross_entropy(logits[-n:], torch.tensor(t[-n:]), reduction="sum"))
    assert float(acc[:, 0].sum()) == pytest.approx(direct, rel=1e-6)


def test_a_diverged_loss_stops_the_run_in_one_line_and_writes_nothing(tiny, tmp_path, capsys, monkeypatch):
    import attnkit.training.finetune as ft

    calls = {"n": 0}

    def nan_from_the_third(*args, **kwargs):
        loss, parts = heal_loss(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan"), parts) if calls["n"] >= 3 else (loss, parts)

    monkeypatch.setattr(ft, "heal_loss", nan_from_the_third)
    recipe = base_recipe(tmp_path, tiny["mla"], tiny["llama"], tiny["corpus"])
    assert run_cli(write_recipe(tmp_path / "r.yaml", **recipe)) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("attnkit: error: training diverged at step 3: ") and "Traceback" not in err
    assert "loss nan" in last and "grad_norm nan" in last
    assert "train.lr, now 0.01" in last
    assert calls["n"] == 3 and not (tmp_path / "out").exists()  # stopped at once; no model written


@given(n=st.integers(1, 9), world=st.integers(1, 8))
@settings(max_examples=60, deadline=None)
def test_validation_rows_are_even_over_processes_and_keep_the_mean(n, world):
    """Every process must run as many validation forwards (they are collectives under DDP/FSDP: a process
    with one forward more waits forever); a split shorter than the process count is repeated whole."""
    from attnkit.training.batches import even_validation_rows

    rows = torch.arange(n).unsqueeze(1).repeat(1, 3)  # [n, 3], row i filled with i
    even = even_validation_rows(rows, world)
    assert len(even) % world == 0 and len(even) > 0
    shares = [even[rank::world] for rank in range(world)]
    assert len({len(s) for s in shares}) == 1
    if n >= world:
        assert torch.equal(even, rows[: len(even)]) and len(even) > n - world
    else:  # each row counted equally often: the mean over the repeated set is the rows' mean
        counts = torch.bincount(even[:, 0], minlength=n)
        assert len(set(counts.tolist())) == 1
        assert even.float().mean() == rows.float().mean()


def test_validation_rows_refuse_an_empty_split():
    from attnkit.training.batches import even_validation_rows

    with pytest.raises(AttnkitError, match="no row"):
        even_validation_rows(torch.zeros(0, 4, dtype=torch.long), 2)


def test_the_chunked_cross_entropy_heals_as_the_whole_logits_do(tiny, tmp_path, monkeypatch):
    """The heal-mla loss (cross-entropy + hidden states, no KL) on a bf16 pair, the cross-entropy over the LM
    head in chunks of 8 positions (`chunked_head`, the default) and over whole logits
    (`train.chunked_head: false`): the same loss curve and trained weights, to float rounding."""
    from transformers import AutoModelForCausalLM

    from attnkit.training import chunked_head

    monkeypatch.setattr(chunked_head, "CHUNK_BYTES", 8 * 4 * tiny["tokenizer"].vocab_size)
    paths = []
    for src in (tiny["mla"], tiny["llama"]):
        out = tmp_path / "pair" / src.name
        AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(out)
        tiny["tokenizer"].save_pretrained(out)
        paths.append(out)
    reports = {}
    for name, chunked in (("chunked", True), ("whole", False)):
        recipe = base_recipe(tmp_path / name, *paths, tiny["corpus"])
        recipe["train"].update(trainable="new", patterns=[r"kv_b_proj", r"q_proj"], chunked_head=chunked)
        recipe["loss"].update(ce_weight=1.0, kl_weight=0.0, hidden_weight=30.0)
        (tmp_path / name).mkdir()
        reports[name] = train(write_recipe(tmp_path / name / "r.yaml", **recipe))
    uses = ["in chunks of positions" in " ".join(reports[n]["notes"]) for n in ("chunked", "whole")]
    assert uses == [True, False]
    (a, b) = (torch.tensor([loss for _, loss in reports[n]["loss_curve"]]) for n in ("chunked", "whole"))
    assert len(a) >= 3 and torch.allclose(a, b, rtol=1e-5), (a, b)
    for when in ("eval_before", "eval_after", "eval_teacher"):  # the validation losses are chunked too
        va, vb = (reports[n][when]["validation"]["loss"] for n in ("chunked", "whole"))
        assert abs(va - vb) <= 1e-4 * abs(vb), (when, va, vb)
    wa, wb = (load_file(str(tmp_path / n / "out" / "model.safetensors")) for n in ("chunked", "whole"))
    assert all(torch.allclose(wa[k].float(), wb[k].float(), atol=1e-3) for k in wa)


def test_a_bf16_pair_heals_exactly_like_its_fp32_copy(tiny, tmp_path, capfd):
    """A bf16 student and teacher (real checkpoints' dtype) are held in bf16 (the student's frozen parameters,
    the whole teacher) and computed in fp32 (`attnkit/training/frozen.py`): the same run as on fp32 copies of
    the same values, loss for loss, and the same trained weights; and the same again with
    `train.frozen_dtype: fp32`, which reads the bf16 pair in fp32 instead of holding it in bf16."""
    from transformers import AutoModelForCausalLM

    pairs = {}
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        paths = []
        for src in (tiny["mla"], tiny["llama"]):
            out = tmp_path / name / src.name
            AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).to(dtype).save_pretrained(out)
            tiny["tokenizer"].save_pretrained(out)
            paths.append(out)
        pairs[name] = paths
    pairs["bf16-unheld"] = pairs["bf16"]
    reports, teacher_lines = {}, {}
    for name, (student, teacher) in pairs.items():
        recipe = base_recipe(tmp_path / name, student, teacher, tiny["corpus"])
        recipe["train"].update(trainable="new", patterns=[r"kv_b_proj", r"kv_a_layernorm"])
        if name == "bf16-unheld":
            recipe["train"]["frozen_dtype"] = "fp32"
        recipe["loss"].update(kl_weight=1.0, hidden_weight=1.0)
        capfd.readouterr()
        (tmp_path / name).mkdir(exist_ok=True)
        reports[name] = train(write_recipe(tmp_path / name / "r.yaml", **recipe))
        teacher_lines[name] = [line for line in capfd.readouterr().err.splitlines() if "teacher loaded" in line]
    notes = " ".join(reports["bf16"]["notes"])
    assert "frozen parameter tensor(s) held in bfloat16" in notes
    assert "(held in bfloat16, computed in fp32)" in teacher_lines["bf16"][0]
    for name in ("fp32", "bf16-unheld"):
        assert "held in" not in " ".join(reports[name]["notes"] + teacher_lines[name]), name
    for name in ("fp32", "bf16-unheld"):
        assert reports["bf16"]["loss_curve"] == reports[name]["loss_curve"], name
    a, b, c = (load_file(str(tmp_path / n / "out" / "model.safetensors")) for n in ("bf16", "fp32", "bf16-unheld"))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k].to(a[k].dtype)) and torch.equal(a[k], c[k]) for k in a)
