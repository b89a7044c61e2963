"""Teacher log-probs precomputed to disk (`teacher_cache:`): losses, exactness, refusals, resume, processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from test_finetune_fixtures import base_recipe, tiny, write_recipe  # noqa: F401

from attnkit.cli import main as cli_main
from attnkit.errors import AttnkitError
from attnkit.training.losses import TeacherTargets, distill_kl, distill_kl_targets, heal_loss, topk_targets
from attnkit.training.recipe import load_finetune_recipe


def train(path, *overrides):
    from attnkit.training.finetune import run

    return run(load_finetune_recipe(path, list(overrides)))


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def assert_same_weights(a, b, atol):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def cache_recipe(tmp_path, tiny, **cache):  # noqa: F811
    recipe = base_recipe(tmp_path, tiny["mla"], tiny["llama"], tiny["corpus"])
    recipe["train"]["max_steps"] = 6
    recipe["teacher_cache"] = {"dir": str(tmp_path / "cache"), **cache}
    return recipe


# ------------------------------------------------------------------ losses


@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 3), length=st.integers(1, 5), vocab=st.integers(3, 40), temp=st.floats(0.5, 3.0), seed=st.integers(0, 99))
def test_topk_kl_bounds_and_limits(b, length, vocab, temp, seed):
    torch.manual_seed(seed)
    s, t = torch.randn(b, length, vocab) * 3, torch.randn(b, length, vocab) * 3
    full = distill_kl(s, t, temp)
    # top_k null (or k = V) is the full distribution: the same loss as the in-process teacher
    torch.testing.assert_close(distill_kl_targets(s, topk_targets(t, temp, None), temp), full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(distill_kl_targets(s, topk_targets(t, temp, vocab), temp), full, rtol=1e-6, atol=1e-6)
    # k + rest bucket: coarse-graining never increases KL, and more k never decreases it
    k1, k2 = max(1, vocab // 4), max(1, vocab // 2)
    kl1 = distill_kl_targets(s, topk_targets(t, temp, k1), temp)
    kl2 = distill_kl_targets(s, topk_targets(t, temp, k2), temp)
    assert -1e-6 <= float(kl1) <= float(kl2) + 1e-5 and float(kl2) <= float(full) + 1e-5
    # identical distributions: zero for any k
    assert float(distill_kl_targets(t, topk_targets(t, temp, k1), temp)) == pytest.approx(0.0, abs=1e-5)


def test_topk_kl_is_the_bucketed_definition_and_has_finite_gradients():
    torch.manual_seed(0)
    s = torch.randn(2, 3, 10, requires_grad=True)
    t = torch.randn(2, 3, 10)
    targets = topk_targets(t, 2.0, 4)
    assert targets.logprobs.shape == (2, 3, 4) and targets.ids.dtype == torch.int32 and targets.rest.shape == (2, 3)
    p, q = F.softmax(t / 2.0, -1), F.softmax(s / 2.0, -1)
    top = p.topk(4, -1).indices
    mask = torch.zeros_like(p, dtype=torch.bool).scatter(-1, top, True)
    p_b = torch.cat([p.gather(-1, top), (p * ~mask).sum(-1, keepdim=True)], -1)  # [2, 3, 5]
    q_b = torch.cat([q.gather(-1, top), (q * ~mask).sum(-1, keepdim=True)], -1)
    manual = (p_b * (p_b.log() - q_b.log())).sum(-1).mean() * 4.0
    loss = distill_kl_targets(s, targets, 2.0)
    torch.testing.assert_close(loss, manual, rtol=1e-5, atol=1e-6)
    loss.backward()
    assert torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0
    total, parts = heal_loss(s, torch.zeros(2, 3, dtype=torch.long), targets, 0.0, 1.0, 2.0)
    assert parts["kl"] == pytest.approx(float(manual.detach()), rel=1e-5)


@pytest.mark.parametrize("top_k", [3, None])
def test_teacher_targets_move_and_keep_fields(top_k):
    """`.to()` moves every tensor field (a field it forgot would stay behind or fall back to its default)
    and keeps dtypes, shapes and values; non-tensor fields (None for full targets) come back unchanged."""
    import dataclasses

    torch.manual_seed(0)
    t = topk_targets(torch.randn(1, 2, 6), 1.0, top_k)
    names = [f.name for f in dataclasses.fields(TeacherTargets)]
    assert names == ["logprobs", "ids", "rest"], "a new field: check that .to() carries it, then update this list"
    moved = t.to("meta")  # another device without a GPU: every tensor must land there
    back = t.to("cpu")
    assert isinstance(moved, TeacherTargets) and isinstance(back, TeacherTargets)
    for name in names:
        before, there, again = getattr(t, name), getattr(moved, name), getattr(back, name)
        if isinstance(before, torch.Tensor):
            assert there.device.type == "meta" and (there.dtype, there.shape) == (before.dtype, before.shape), name
            assert again.device.type == "cpu" and again.dtype == before.dtype and torch.equal(again, before), name
        else:
            assert there == before and again == before, name
    if top_k is not None:
        assert back.ids.dtype == torch.int32 and back.rest.shape == (1, 2)
    else:
        assert back.ids is None and back.rest is None


# ------------------------------------------------------------------ recipe keys


@pytest.mark.parametrize(
    "override, key",
    [
        ("teacher_cache.top_k=0", "teacher_cache.top_k"),
        ("teacher_cache.dtype=int8", "teacher_cache.dtype"),
        ("teacher_cache.dir=", "teacher_cache.dir"),
        ("teacher_cache.sizes=3", "teacher_cache.sizes"),
        ("teacher_cache.rebuild=maybe", "teacher_cache.rebuild"),
        ("loss.kl_weight=0", "teacher_cache"),
        ("loss.hidden_weight=1.0", "loss.hidden_weight"),
    ],
)
def test_bad_cache_keys_name_the_key(tmp_path, override, key):
    path = write_recipe(tmp_path / "r.yaml", model="m", output_dir="o", teacher="t", train={"patterns": ["q"]},
                        teacher_cache={"dir": "c"}, loss={"ce_weight": 1.0})
    with pytest.raises(AttnkitError, match=f"recipe key {key}[:( ]"):
        load_finetune_recipe(path, [override])


def test_cache_settings_are_part_of_the_run_fingerprint(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", model="m", output_dir="o", teacher="t", train={"patterns": ["q"]})
    plain = load_finetune_recipe(path).fingerprint()
    cached = load_finetune_recipe(path, ["teacher_cache.dir=c"]).fingerprint()
    assert plain != cached != load_finetune_recipe(path, ["teacher_cache.dir=c", "teacher_cache.top_k=8"]).fingerprint()
    assert cached == load_finetune_recipe(path, ["teacher_cache.dir=elsewhere", "teacher_cache.rebuild=true"]).fingerprint()


# ------------------------------------------------------------------ end to end


def test_full_cache_trains_exactly_like_the_in_process_teacher(tiny, tmp_path, monkeypatch):  # noqa: F811
    import attnkit.training.finetune as ft

    path = write_recipe(tmp_path / "r.yaml", **cache_recipe(tmp_path, tiny, top_k=None, dtype="fp32"))
    live = train(path, "teacher_cache=null", f"output_dir={tmp_path / 'live'}")
    cached = train(path, f"output_dir={tmp_path / 'cached'}")
    assert [x for _, x in cached["loss_curve"]] == pytest.approx([x for _, x in live["loss_curve"]], rel=1e-5, abs=1e-6)
    assert_same_weights(tmp_path / "live", tmp_path / "cached", atol=1e-6)
    assert cached["eval_teacher"] == live["eval_teacher"] and "built" in " ".join(cached["notes"])

    cache = tmp_path / "cache"
    manifest = json.loads((cache / "manifest.json").read_text())
    fp = manifest["fingerprint"]
    assert fp["top_k"] is None and fp["dtype"] == "fp32" and fp["seq_len"] == 16 and fp["temperature"] == 2.0
    assert fp["teacher"] == str(tiny["llama"].resolve()) and "model.safetensors" in fp["teacher_weights"]
    stored = load_file(str(cache / manifest["shards"][0]["file"]))
    assert stored["logprobs"].shape == (fp["rows"], 16, 300) and sorted(stored["rows"].tolist()) == list(range(fp["rows"]))
    assert not list(tmp_path.glob(".cache.attnkit-tmp-*"))

    # a second run reuses the cache and never loads the teacher
    monkeypatch.setattr(ft, "load_teacher", lambda *a, **k: pytest.fail("teacher loaded despite a valid cache"))
    again = train(path, f"output_dir={tmp_path / 'again'}")
    assert "read from the cache" in " ".join(again["notes"])
    assert_same_weights(tmp_path / "cached", tmp_path / "again", atol=0)


def test_topk_cache_heals_and_is_small(tiny, tmp_path):  # noqa: F811
    recipe = cache_recipe(tmp_path, tiny, top_k=8, dtype="bf16")
    recipe["loss"]["ce_weight"] = 0.0
    report = train(write_recipe(tmp_path / "r.yaml", **recipe))
    assert report["eval_after"]["validation"]["loss"] < report["eval_before"]["validation"]["loss"]
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["bytes_per_token"] == 8 * (2 + 4) + 4
    stored = load_file(str(tmp_path / "cache" / manifest["shards"][0]["file"]))
    assert stored["logprobs"].dtype == torch.bfloat16 and stored["ids"].dtype == torch.int32
    assert stored["rest"].shape == stored["logprobs"].shape[:2]


def test_stale_cache_is_refused_untouched_or_rebuilt(tiny, tmp_path, capsys):  # noqa: F811
    path = write_recipe(tmp_path / "r.yaml", **cache_recipe(tmp_path, tiny, top_k=4))
    train(path, f"output_dir={tmp_path / 'first'}")
    manifest = tmp_path / "cache" / "manifest.json"
    before = manifest.read_text()
    capsys.readouterr()

    assert cli_main(["finetune", "--config", str(path), f"output_dir={tmp_path / 'second'}", "loss.temperature=1.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "made for another run (differs in: temperature)" in err and "\n" not in err
    assert manifest.read_text() == before and not (tmp_path / "second").exists()

    train(path, f"output_dir={tmp_path / 'second'}", "loss.temperature=1.0", "teacher_cache.rebuild=true")
    assert json.loads(manifest.read_text())["fingerprint"]["temperature"] == 1.0

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("mine")
    assert cli_main(["finetune", "--config", str(path), f"output_dir={tmp_path / 'third'}",
                     f"teacher_cache.dir={tmp_path / 'other'}", "teacher_cache.rebuild=true"]) == 2
    assert "holds no manifest.json" in capsys.readouterr().err.strip().splitlines()[-1]
    assert (tmp_path / "other" / "x.txt").read_text() == "mine"


@pytest.mark.slow
def test_resume_with_cache_matches_uninterrupted(tiny, tmp_path, monkeypatch):  # noqa: F811
    import attnkit.training.finetune as ft

    recipe = cache_recipe(tmp_path, tiny, top_k=16)
    recipe["train"]["max_steps"] = 9
    recipe["checkpoint"] = {"every": 3, "keep": 2}
    path = write_recipe(tmp_path / "r.yaml", **recipe)
    train(path, f"output_dir={tmp_path / 'whole'}", f"run_dir={tmp_path / 'whole.run'}")

    real = ft.broadcast_step

    def crash_at_7(model, step, total):
        if step == 7:
            raise KeyboardInterrupt("killed mid-run")
        return real(model, step, total)

    monkeypatch.setattr(ft, "broadcast_step", crash_at_7)
    with pytest.raises(KeyboardInterrupt):
        train(path, f"output_dir={tmp_path / 'resumed'}")
    monkeypatch.setattr(ft, "broadcast_step", real)
    assert not (tmp_path / "resumed").exists()
    train(path, f"output_dir={tmp_path / 'resumed'}")
    assert "resume" in (tmp_path / "resumed.run" / "log.jsonl").read_text()
    assert_same_weights(tmp_path / "whole", tmp_path / "resumed", atol=1e-6)


@pytest.mark.slow
def test_two_processes_build_once_and_match_one_process(tiny, tmp_path):  # noqa: F811
    import os

    recipe = cache_recipe(tmp_path, tiny, top_k=16)
    recipe["train"]["max_steps"] = 4
    path = write_recipe(tmp_path / "r.yaml", **recipe)
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29521",
        "-m", "attnkit.finetune", "--config", str(path), f"output_dir={tmp_path / 'two'}", "train.per_device_batch_size=2",
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    two = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert not list(tmp_path.glob(".cache.attnkit-tmp-*"))
    report = json.loads((tmp_path / "two" / "finetune_report.json").read_text())
    assert report["processes"] == 2 and "built" in " ".join(report["notes"])
    one = train(path, f"output_dir={tmp_path / 'one'}", "train.per_device_batch_size=4")  # reuses the cache
    assert "read from the cache" in " ".join(one["notes"])
    assert_same_weights(tmp_path / "one", tmp_path / "two", atol=2e-5)
