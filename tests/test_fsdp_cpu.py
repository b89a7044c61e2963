"""recipes/accelerate/fsdp.yaml runs for real on 2 CPU processes (gloo): FSDP2 heals exactly like DDP.

The fast part of benchmarks/fsdp_cpu.py (same launch and probe code), on a tiny 2-layer MLA student and
Llama teacher: `accelerate launch --config_file recipes/accelerate/{ddp,fsdp}.yaml --num_processes 2
--mixed_precision no -m attnkit.finetune --config recipes/heal-mla.yaml ...` (through the probe runner).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_benchmark
from safetensors.torch import load_file
from test_finetune_fixtures import build_tokenizer, save_deepseek, save_llama, write_corpus


def fsdp_on_cpu_unavailable() -> str | None:
    """Why this torch/accelerate cannot run FSDP2 on CPU processes here (None: it can)."""
    if not sys.platform.startswith("linux"):
        return "the probe reads /proc/self/status"
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with gloo is not available in this torch build"
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2)"
    try:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model  # noqa: F401
    except ImportError:
        import accelerate

        return f"accelerate {accelerate.__version__} has no FSDP2 support (fsdp2_prepare_model)"
    if shutil.which("accelerate") is None:
        return "the `accelerate` launcher is not on PATH"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(fsdp_on_cpu_unavailable() is not None,
                                                   reason=str(fsdp_on_cpu_unavailable()))]


def in_bf16(folder: Path, out: Path | None = None) -> Path:
    """Stored in bf16, as real checkpoints are: the teacher, and the student's frozen parameters, are held in
    bf16 and computed in fp32 (`attnkit/training/frozen.py`)."""
    from transformers import AutoModelForCausalLM

    out = out or folder
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(out)
    for f in [*folder.glob("tokenizer*"), *folder.glob("special_tokens*")]:
        if out != folder:
            shutil.copy2(f, out / f.name)
    return out


def with_constant_channel(folder: Path) -> Path:
    """Give layer 0's MLA latent a constant channel (zero kv_a_proj row, non-zero bias), as the attnkit
    format has: its gradients must stay zero under FSDP too (trainable.sharded_grad_masks)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    proj = model.model.layers[0].self_attn.kv_a_proj_with_mqa
    with torch.no_grad():
        proj.weight[0] = 0.0
        proj.bias[0] = 5.0
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    corpus = write_corpus(root / "corpus.jsonl")
    tok = build_tokenizer(corpus)
    teacher = in_bf16(save_llama(root / "llama", tok, layers=2, tie=False))  # embeddings, LM head: units of their own
    student = save_deepseek(root / "mla", tok, layers=2, attention_bias=True)  # the bias a constant channel needs
    student = with_constant_channel(student)
    # the student in bf16 too: its frozen parameters held in bf16 (DDP: module hooks; FSDP: bf16 shards gathered
    # in fp32); its fp32 original where a test needs updates finer than bf16 shows
    return {"root": root, "corpus": corpus, "teacher": teacher, "student": in_bf16(student, root / "mla-bf16"),
            "student_fp32": student}


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def base_overrides(pair: dict, steps: int, student: Path | None = None) -> list[str]:
    return [f"model={student or pair['student']}", f"teacher={pair['teacher']}", f"data.source={pair['corpus']}",
            "data.seq_len=16", "data.val_tokens=64", f"train.max_steps={steps}", "train.per_device_batch_size=2",
            "train.warmup_steps=1", "eval.tasks=null", "eval.every=0", "log.tensorboard=false"]


def same_weights_constant_channel_kept(tmp_path: Path, student: Path) -> tuple[dict, dict]:
    """The FSDP and DDP runs' saved weights agree (in the student's dtype: to 1e-5 in fp32, to one step in bf16,
    where the two runs' fp32 values fall on either side of a rounding boundary) and neither moved layer 0's
    constant latent channel (its kv_a_proj row and bias, its kv_a_layernorm weight, its kv_b_proj column);
    returns FSDP's and the start."""
    a, b, start = weights(tmp_path / "fsdp"), weights(tmp_path / "ddp"), weights(student)
    step = {torch.float32: 0.0, torch.bfloat16: 2**-7}  # relative rounding step of the stored dtype
    assert all(bool(((a[k] - b[k]).abs().float() <= b[k].abs().float() * step[b[k].dtype] + 1e-5).all()) for k in a)
    prefix = "model.layers.0.self_attn."
    for w in (a, b):
        assert torch.equal(w[prefix + "kv_a_proj_with_mqa.weight"][0], start[prefix + "kv_a_proj_with_mqa.weight"][0])
        assert torch.equal(w[prefix + "kv_a_proj_with_mqa.bias"][0], start[prefix + "kv_a_proj_with_mqa.bias"][0])
        assert torch.equal(w[prefix + "kv_b_proj.weight"][:, 0], start[prefix + "kv_b_proj.weight"][:, 0])
        assert torch.equal(w[prefix + "kv_a_layernorm.weight"][0], start[prefix + "kv_a_layernorm.weight"][0])
        assert not torch.equal(w[prefix + "kv_b_proj.weight"][:, 1], start[prefix + "kv_b_proj.weight"][:, 1])
    return a, start


def test_fsdp_matches_ddp_and_resumes_exactly(pair, tmp_path):
    bench = load_benchmark("fsdp_cpu.py", "fsdp_cpu_bench")
    overrides = base_overrides(pair, 4)
    ckpt = ["checkpoint.every=2", "checkpoint.keep=2"]
    ddp = bench.launch("ddp", tmp_path, "ddp", overrides + ["checkpoint.every=0"], env_extra=ENV, timeout=300)
    assert ddp["returncode"] == 0, ddp.get("stderr_tail")
    fsdp = bench.launch("fsdp", tmp_path, "fsdp", overrides + ckpt, env_extra=ENV, timeout=300)
    assert fsdp["returncode"] == 0, fsdp.get("stderr_tail")

    # one process group of 2 in each (not two worlds of one), FSDP really sharded
    assert ddp["processes"] == fsdp["processes"] == 2
    assert [p["distributed_type"] for p in ddp["probes"]] == ["DistributedType.MULTI_CPU"] * 2
    assert [p["distributed_type"] for p in fsdp["probes"]] == ["DistributedType.FSDP"] * 2
    # the student's frozen 16-bit embeddings and LM head (one table here: tied) split by vocabulary rows
    # (sharded_load.vocab_tables), the rest sharded by FSDP: the processes' parts add up to DDP's copy
    start = weights(pair["student"])
    tables = [k for k in ("model.embed_tokens.weight", "lm_head.weight") if k in start]
    assert all(p["sharded_params"] == p["params"] > 0 for p in fsdp["probes"])
    assert sum(p["student_weights"] for p in fsdp["probes"]) == ddp["probes"][0]["student_weights"]
    assert sum(p["adam_state"] for p in fsdp["probes"]) == ddp["probes"][0]["adam_state"]
    assert any(n.startswith(f"{len(tables)} frozen embedding table(s) split by vocabulary rows") for n in fsdp["notes"])
    # the teacher's decoder layers sharded too, its untied 16-bit embeddings and LM head split like the
    # student's table (sharded_load.shard_teacher_layers); only its final norm (32 bf16) is whole on each process
    teacher = weights(pair["teacher"])
    assert "lm_head.weight" in teacher  # untied: two tables
    assert sum(p["teacher_weights"] for p in fsdp["probes"]) == ddp["probes"][0]["teacher_weights"] + 32 * 2
    assert ddp["probes"][0]["teacher_weights"] == sum(t.numel() * 2 for t in weights(pair["teacher"]).values())  # bf16
    assert any("teacher: 2 decoder layers sharded" in n for n in fsdp["notes"])
    # no process reads a model whole: each builds both empty and reads only its own shards from the checkpoints
    by_rank = sorted(fsdp["probes"], key=lambda p: p["rank"])
    assert [p["whole_loads"] for p in by_rank] == [[], []]
    assert all(sorted(p["whole_loads"]) == sorted([str(pair["student"]), str(pair["teacher"])]) for p in ddp["probes"])
    assert "1 constant MLA latent channel(s) kept frozen (their gradients are zeroed)" in fsdp["notes"]
    held = [n for n in fsdp["notes"] if "frozen parameter tensor(s) held in bfloat16" in n]
    assert held and held == [n for n in ddp["notes"] if "held in bfloat16" in n]

    # the same batches give the same loss at every step (fp32)
    assert sorted(ddp["losses"]) == sorted(fsdp["losses"]) == [1, 2, 3, 4]
    assert bench.max_diff(fsdp["losses"], ddp["losses"]) < 1e-4
    a, start = same_weights_constant_channel_kept(tmp_path, pair["student"])
    assert any(not torch.equal(a[k], start[k]) for k in a)

    # resume under FSDP from the step-2 checkpoint (sharded model + optimizer, scheduler, RNG): a fresh
    # launch on a copy of the run folder finishes steps 3-4 exactly as the uninterrupted run did
    run = tmp_path / "fsdp.run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]
    resumed_run = tmp_path / "resumed.run"
    (resumed_run / "checkpoints").mkdir(parents=True)
    shutil.copy2(run / "run.json", resumed_run / "run.json")
    shutil.copytree(run / "checkpoints" / "step-000002", resumed_run / "checkpoints" / "step-000002")
    resumed = bench.launch("fsdp", tmp_path, "resumed", overrides + ckpt, env_extra=ENV, timeout=300)
    assert resumed["returncode"] == 0, resumed.get("stderr_tail")
    assert resumed["resumed_from"].endswith("step-000002")
    assert sorted(resumed["losses"]) == [3, 4]
    assert resumed["losses"] == {s: fsdp["losses"][s] for s in (3, 4)}
    assert resumed["loss_curve"] == fsdp["loss_curve"]
    r = weights(tmp_path / "resumed")
    assert all(torch.equal(r[k], a[k]) for k in a)


def test_fsdp_trains_the_rest_at_rest_lr_as_ddp_does(pair, tmp_path):
    """`train.rest_lr`: a second AdamW group (every other parameter) survives FSDP's parameter swap; the
    constant latent channel stays frozen."""
    bench = load_benchmark("fsdp_cpu.py", "fsdp_cpu_bench")
    overrides = base_overrides(pair, 2, pair["student_fp32"]) + ["train.rest_lr=1e-4", "checkpoint.every=0"]
    runs = {kind: bench.launch(kind, tmp_path, kind, overrides, env_extra=ENV, timeout=300) for kind in ("ddp", "fsdp")}
    for run in runs.values():
        assert run["returncode"] == 0, run.get("stderr_tail")
    assert bench.max_diff(runs["fsdp"]["losses"], runs["ddp"]["losses"]) < 1e-4
    a, start = same_weights_constant_channel_kept(tmp_path, pair["student_fp32"])
    assert not [k for k in a if torch.equal(a[k], start[k])]  # MLPs, norms and embeddings moved too
