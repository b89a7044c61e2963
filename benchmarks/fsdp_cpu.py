"""FSDP2 healing on CPU processes (gloo) through accelerate, against DDP on the same batches.

    python benchmarks/fsdp_cpu.py -o benchmarks/results/fsdp_cpu.json     # the README's MLA conversion of `reference`
    python benchmarks/fsdp_cpu.py --wide 1024x8 --kill-at 0 -o benchmarks/results/fsdp_cpu_wide.json  # ~110M each

Runs `recipes/heal-mla.yaml` three (or four) times with `accelerate launch --num_processes 2`, the shipped
accelerate configs unchanged but for `--mixed_precision no` (fp32, so the two can agree to 1e-4):

  ddp      recipes/accelerate/ddp.yaml                    the baseline
  fsdp     recipes/accelerate/fsdp.yaml, a checkpoint every --checkpoint-every steps
  killed   the same FSDP run, rank 0 SIGKILLed when step --kill-at is about to run (torchrun ends the other)
  resumed  the killed run's command again: resumes from its newest checkpoint and finishes

and writes one JSON: every command as run, the loss of every step (full precision, from each run's log.jsonl),
the largest |FSDP - DDP| and |resumed - uninterrupted| loss differences, the final weights' largest difference,
and per process: peak RSS (VmHWM of /proc/self/status) of the whole run and of its parts: loading (start to
step 1), training (VmHWM reset through /proc/self/clear_refs just before step 1, read after the last step) and
step 1 to exit (training and the export),
and the bytes of the model state the process holds (local shards of DTensors: student weights, AdamW
state, teacher weights), from a probe that wraps the trainer (PROBE below; the trainer itself is unchanged).

`tests/test_fsdp_cpu.py` runs the fast part of this (a tiny pair, 4 steps, a copied checkpoint instead of a
kill) with the functions below.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "heal-mla.yaml"
CONFIGS = {"ddp": ROOT / "recipes" / "accelerate" / "ddp.yaml", "fsdp": ROOT / "recipes" / "accelerate" / "fsdp.yaml"}

# Runs `python -m attnkit.finetune ARGS` in this process, with the trainer's optimizer step wrapped to:
# reset the peak RSS before step 1, read it after every step, optionally SIGKILL rank 0 before step KILL_AT,
# and write PROBE_DIR/rank<R>.json at exit with the peaks and the bytes of model state this process holds.
PROBE = r'''
import json, os, signal, sys, threading, time
import torch
import attnkit.training.finetune as ft
import attnkit.training.models as models

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None

def local_bytes(tensors):
    from torch.distributed.tensor import DTensor
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total

def anon():  # this process's own memory (RssAnon): the tensors it allocated, not the checkpoint's mmapped file pages
    return status("RssAnon")

class Sampler(threading.Thread):
    """max RssAnon every 5 ms between the start of step 1 and the end of the last step."""
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.running = 0, True
    def run(self):
        while self.running:
            self.peak = max(self.peak, anon() or 0)
            time.sleep(0.005)

seen = {"train_peak_rss": None}
sampler = Sampler()
def before_models(load):
    def probed(*args, **kwargs):  # the runtime, tokenizer and data, before any model
        seen.setdefault("anon_before_models", anon())
        return load(*args, **kwargs)
    return probed
ft.load_teacher = before_models(ft.load_teacher)
ft.load_fsdp_teacher = before_models(ft.load_fsdp_teacher)  # FSDP: the teacher read shard by shard
seen["whole_loads"] = []  # the models this process read whole (from_pretrained): student and teacher alike
real_load_causal_lm = models.load_causal_lm
def probed_load_causal_lm(path, *args, **kwargs):
    seen["whole_loads"].append(str(path))
    return real_load_causal_lm(path, *args, **kwargs)
models.load_causal_lm = probed_load_causal_lm

def record_grad_norms(accelerator, model):
    """Step 1 only: each trainable tensor's whole gradient norm before clipping, by name (a collective
    under FSDP: every process gathers the same tensors in the same order)."""
    from torch.distributed.tensor import DTensor
    from attnkit.training.trainable import canonical_name
    real_clip = accelerator.clip_grad_norm_
    def clip(params, *args, **kwargs):
        norms = {}
        for name, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                norms[canonical_name(name).removeprefix("module.")] = float(g.double().norm())  # module.: DDP's
        seen["step1_grad_norms"] = norms
        accelerator.clip_grad_norm_ = real_clip
        return real_clip(params, *args, **kwargs)
    accelerator.clip_grad_norm_ = clip

real_step = ft._optimizer_step
def probed_step(accelerator, model, teacher, cache, data_iter, optimizer, *args, **kwargs):
    step = args[3] if len(args) > 3 else kwargs["step"]
    if os.environ.get("KILL_AT") and step + 1 == int(os.environ["KILL_AT"]) and accelerator.is_main_process:
        os.kill(os.getpid(), signal.SIGKILL)
    if seen["train_peak_rss"] is None:
        seen["load_peak_rss"] = status("VmHWM")  # start to step 1: both models loaded, sharded, optimizer built
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS now; what follows is the training peak
        seen["anon_before_training"] = anon()
        sampler.start()
        if os.environ.get("GRAD_NORMS"):
            record_grad_norms(accelerator, model)
    out = real_step(accelerator, model, teacher, cache, data_iter, optimizer, *args, **kwargs)
    params = list(model.parameters())  # what this process holds after the step (before the export casts it)
    state = [v for s in optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    seen.update(
        train_peak_rss=status("VmHWM"), train_peak_anon=max(sampler.peak, anon()), rank=accelerator.process_index, world=accelerator.num_processes,
        distributed_type=str(accelerator.distributed_type),
        student_weights=local_bytes(params),
        student_trainable_weights=local_bytes(p for p in params if p.requires_grad),
        adam_state=local_bytes(state),
        teacher_weights=local_bytes(teacher.parameters()) if teacher is not None else 0,
        sharded_params=sum(type(p).__name__ == "DTensor" for p in params), params=len(params),
        cuda_max_allocated=torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
    )
    return out
ft._optimizer_step = probed_step

from attnkit.finetune import main
rc = main(sys.argv[1:])
sampler.running = False
since_step1 = status("VmHWM")  # training and the export (rank 0 gathers the whole student to write it)
probe = {**seen, "step1_to_exit_peak_rss": since_step1, "peak_rss": max(seen.get("load_peak_rss") or 0, since_step1),
         "rss_at_exit": status("VmRSS")}
with open(os.path.join(os.environ["PROBE_DIR"], f"rank{seen['rank']}.json"), "w") as f:
    json.dump(probe, f)
sys.exit(rc)
'''

ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
# the README's quick-start conversion of the bundled reference (29.7 % of its KV cache)
CONVERT_REF = ["attnkit", "convert", "--to", "mla", "reference", "-o", "WORK/ref-mla", "--kv-lora-rank", "28",
               "--rope-dim", "48"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(kind: str, work: Path, name: str, overrides: list[str], procs: int = 2, kill_at: int | None = None,
           timeout: int = 900, env_extra: dict | None = None, mixed_precision: str = "no") -> dict:
    """One `accelerate launch` of the recipe under CONFIGS[kind]; returns the command, exit status, seconds,
    the loss per step (log.jsonl of this launch), the report's loss curve and each process's probe."""
    runner = work / "probe_runner.py"
    runner.write_text(PROBE)
    probes = work / f"{name}.probe"
    shutil.rmtree(probes, ignore_errors=True)
    probes.mkdir(parents=True)
    out = work / name
    rel = lambda p: os.path.relpath(p, ROOT)  # noqa: E731  (the launch runs in the repository root)
    cmd = ["accelerate", "launch", "--config_file", rel(CONFIGS[kind]), "--num_processes", str(procs),
           "--mixed_precision", mixed_precision, "--main_process_port", str(free_port()), str(runner),
           "--config", rel(RECIPE), *overrides, f"output_dir={out}", f"run_dir={out}.run"]
    env = {**os.environ, **ENV, **(env_extra or {}), "PROBE_DIR": str(probes)}
    env.pop("ACCELERATE_USE_CPU", None)  # the configs as a user runs them
    if kill_at is not None:
        env["KILL_AT"] = str(kill_at)
    log_file = out.with_name(out.name + ".run") / "log.jsonl"
    lines_before = len(log_file.read_text().splitlines()) if log_file.is_file() else 0
    began = time.perf_counter()
    # `accelerate launch` as this interpreter's module: the same launcher where its script is not on PATH
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *cmd[2:]], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    user = cmd[: cmd.index(str(runner))] + ["-m", "attnkit.finetune"] + cmd[cmd.index(str(runner)) + 1:]
    result = {"command": shlex.join(cmd), "without_probe": shlex.join(user), "env": {**ENV, **(env_extra or {}), **({"KILL_AT": str(kill_at)} if kill_at else {})},
              "returncode": proc.returncode, "seconds": round(time.perf_counter() - began, 1)}
    entries = [json.loads(x) for x in log_file.read_text().splitlines()[lines_before:]] if log_file.is_file() else []
    result["losses"] = {e["step"]: e["loss"] for e in entries if "loss" in e}
    result["grad_norms"] = {e["step"]: e["grad_norm"] for e in entries if "grad_norm" in e}  # before clipping
    result["resumed_from"] = next((e["from"] for e in entries if e.get("event") == "resume"), None)
    report = out / "finetune_report.json"
    if report.is_file():
        data = json.loads(report.read_text())
        result.update(loss_curve=data["loss_curve"], notes=data["notes"], trainable=data["trainable"],
                      processes=data["processes"])
    result["probes"] = [json.loads(p.read_text()) for p in sorted(probes.glob("rank*.json"))]
    if proc.returncode != 0 and kill_at is None:
        result["stderr_tail"] = proc.stderr[-4000:]
    return result


def max_diff(a: dict, b: dict) -> float:
    """Largest |a[step] - b[step]| over the steps both have (keys may be int or str)."""
    a, b = {int(k): v for k, v in a.items()}, {int(k): v for k, v in b.items()}
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("no common steps")
    return max(abs(a[s] - b[s]) for s in common)


def weights_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    def load(folder):
        out = {}
        for f in sorted(glob.glob(str(folder / "*.safetensors"))):
            out.update(load_file(f))
        return out

    wa, wb = load(a), load(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


def grad_norm_diffs(run: dict, base: dict, top: int = 8) -> dict:
    """Step-1 gradient norms, tensor by tensor: the largest relative differences and where they are."""
    a, b = run["probes"][0]["step1_grad_norms"], base["probes"][0]["step1_grad_norms"]
    if a.keys() != b.keys():
        raise SystemExit(f"the runs' trainable tensors differ: {sorted(a.keys() ^ b.keys())[:4]}")
    rel = {k: abs(a[k] - b[k]) / max(abs(b[k]), 1e-30) for k in a}
    worst = sorted(rel, key=rel.get, reverse=True)[:top]
    total = lambda n: sum(v * v for v in n.values()) ** 0.5  # noqa: E731
    return {"tensors": len(a), "total": [total(a), total(b)], "max_relative_diff": rel[worst[0]] if worst else 0.0,
            "worst": [{"tensor": k, "fsdp": a[k], "baseline": b[k], "relative_diff": rel[k]} for k in worst]}


def build_wide(work: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    """A random DeepSeek-V3 (MLA) student and Llama teacher of the reference's kind, `hidden` wide and
    `layers` deep, with the bundled reference's tokenizer, stored in bf16 as released checkpoints are (the
    trainer loads fp32: every weight a copy in anonymous memory, none left as pages of the mmapped file)."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    from attnkit.io.resolve import resolve_model

    ref = resolve_model("reference")
    tok = AutoTokenizer.from_pretrained(ref)
    heads = hidden // 64
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048,
                  tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    teacher, student = work / f"wide-{hidden}x{layers}-llama", work / f"wide-{hidden}x{layers}-mla"
    if not (teacher / "config.json").is_file():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**common, head_dim=64)).to(torch.bfloat16).save_pretrained(teacher)
        tok.save_pretrained(teacher)
    if not (student / "config.json").is_file():
        torch.manual_seed(1)
        config = DeepseekV3Config(**common, moe_intermediate_size=3 * hidden, first_k_dense_replace=layers,
                                  q_lora_rank=hidden // 4, kv_lora_rank=hidden // 8, qk_rope_head_dim=32,
                                  qk_nope_head_dim=64, v_head_dim=64, rope_interleave=False)
        DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(student)
        tok.save_pretrained(student)
    return student, teacher


def summarize(runs: dict, baseline: str = "ddp") -> dict:
    """The numbers the docs quote: loss agreement, resume exactness, per-process memory."""
    mb = lambda x: None if x is None else round(x / 2**20, 1)  # noqa: E731  (MiB)
    out = {f"fsdp_vs_{baseline}_max_loss_diff": max_diff(runs["fsdp"]["losses"], runs[baseline]["losses"])}
    resumed = runs.get("resumed")
    if resumed:
        out["resumed_from"] = resumed["resumed_from"]
        out["resumed_vs_uninterrupted_max_loss_diff"] = max_diff(resumed["losses"], runs["fsdp"]["losses"])
        out["resumed_steps"] = sorted(int(k) for k in resumed["losses"])
    keys = ("peak_rss", "load_peak_rss", "train_peak_rss", "step1_to_exit_peak_rss", "anon_before_models", "anon_before_training", "train_peak_anon",
            "student_weights", "student_trainable_weights", "adam_state", "teacher_weights")
    out["memory_mib"] = {
        name: [{k: mb(p.get(k)) for k in keys} | {
            "rank": p["rank"],
            # what the models and training add to the process: its peak minus what it held before any model
            "train_peak_anon_minus_before_models": mb(p["train_peak_anon"] - p["anon_before_models"])
            if p.get("anon_before_models") else None,
        } for p in run["probes"]]
        for name, run in runs.items() if run.get("probes")
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", help="a converted MLA folder (its teacher: the source in its report); default: "
                                          "WORK/ref-mla, made (once) by " + shlex.join(CONVERT_REF))
    parser.add_argument("--teacher", default=None, help="teacher (default: the recipe's `source`)")
    parser.add_argument("--wide", default=None, help="HIDDENxLAYERS: build a random pair instead of --student")
    parser.add_argument("--work", default="/tmp/fsdp_cpu_bench")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=4, help="SIGKILL rank 0 before this step (0: no kill run)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1, help="per-process batch (rows)")
    parser.add_argument("--trainable", default="new", help="train.trainable (new: the recipe's)")
    parser.add_argument("--baseline", choices=["ddp", "single"], default="ddp",
                        help="what FSDP is checked against: 2 DDP processes, or one process taking both processes' "
                             "rows per step as 2 accumulated micro-batches (each row's forward and backward alone, "
                             "as each DDP or FSDP process runs it; for pairs two whole copies of which do not fit)")
    parser.add_argument("--mmap-threshold", type=int, default=65536,
                        help="MALLOC_MMAP_THRESHOLD_ for every process (0: glibc's default): allocations above it are "
                             "mmapped and unmapped when freed, so RSS follows the live tensors instead of what the "
                             "heap kept for reuse (both runs alike)")
    parser.add_argument("--grad-norms", action="store_true",
                        help="record each trainable tensor's step-1 gradient norm (before clipping) in both runs and "
                             "report the tensors that differ most")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for every run (e.g. train.lr=5e-5); repeatable")
    parser.add_argument("-o", "--output", default="benchmarks/results/fsdp_cpu.json")
    args = parser.parse_args()

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    overrides = [f"train.max_steps={args.steps}", f"data.seq_len={args.seq_len}",
                 f"train.per_device_batch_size={args.batch}", f"data.val_tokens={2 * args.seq_len * 2}",
                 "eval.tasks=null", "eval.every=0", "log.tensorboard=false", f"train.trainable={args.trainable}",
                 *args.set]
    if args.wide:
        hidden, layers = (int(x) for x in args.wide.lower().split("x"))
        student, teacher = build_wide(work, hidden, layers)
        overrides += [f"model={student}", f"teacher={teacher}"]
        made_by = f"benchmarks/fsdp_cpu.py build_wide({hidden}, {layers}): random weights, bf16"
    else:
        student, made_by = (Path(args.student).resolve() if args.student else None), None
        if not student:
            student, made_by = work / "ref-mla", shlex.join(CONVERT_REF).replace("WORK", str(work))
            if not (student / "config.json").is_file():
                subprocess.run([*CONVERT_REF[:6], str(student), *CONVERT_REF[7:]], check=True, env={**os.environ, **ENV})
        teacher = str(Path(args.teacher).resolve()) if args.teacher and Path(args.teacher).exists() else args.teacher
        overrides += [f"model={student}"] + ([f"teacher={teacher}"] if teacher else [])
    for name in ("ddp", "single", "fsdp", "killed"):
        for suffix in ("", ".run", ".probe"):
            shutil.rmtree(work / f"{name}{suffix}", ignore_errors=True)

    env = {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}
    if args.grad_norms:
        env["GRAD_NORMS"] = "1"
    if args.baseline == "ddp":
        runs = {"ddp": launch("ddp", work, "ddp", overrides + ["checkpoint.every=0"], env_extra=env)}
    else:  # one process, the rows of both FSDP processes as 2 micro-batches: rank 0's rows, then rank 1's
        # (one batch of both rows would round differently: other GEMM shapes, not what a process computes)
        runs = {"single": launch("ddp", work, "single", overrides + ["train.grad_accum=2", "checkpoint.every=0"],
                                 procs=1, env_extra=env, timeout=3600)}
    ckpt = [f"checkpoint.every={args.checkpoint_every}", "checkpoint.keep=2"]
    runs["fsdp"] = launch("fsdp", work, "fsdp", overrides + ckpt, env_extra=env, timeout=3600)
    if args.kill_at:
        runs["killed"] = launch("fsdp", work, "killed", overrides + ckpt, kill_at=args.kill_at, env_extra=env)
        if runs["killed"]["returncode"] == 0 or (work / "killed").exists():
            raise SystemExit("the killed run was not killed: " + runs["killed"]["command"])
        runs["resumed"] = launch("fsdp", work, "killed", overrides + ckpt, env_extra=env)
    for name, run in runs.items():
        if name != "killed" and run["returncode"] != 0:
            print(run.get("stderr_tail", ""), file=sys.stderr)
            raise SystemExit(f"{name} failed: {run['command']}")
    result = {
        "what": "recipes/heal-mla.yaml on 2 CPU processes (gloo), fp32: FSDP2 vs "
                + ("DDP" if args.baseline == "ddp" else "one process with both processes' rows")
                + (", and an FSDP kill + resume" if args.kill_at else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), torch "
                   f"{__import__('torch').__version__}, accelerate {__import__('accelerate').__version__}",
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "student_made_by": made_by,
        "summary": summarize(runs, args.baseline),
        "final_weights_max_diff": {
            f"fsdp_vs_{args.baseline}": weights_diff(work / "fsdp", work / args.baseline),
            **({"resumed_vs_uninterrupted": weights_diff(work / "killed", work / "fsdp")} if args.kill_at else {}),
        },
        "runs": runs,
    }
    if args.grad_norms:
        result["summary"]["step1_grad_norms"] = grad_norm_diffs(runs["fsdp"], runs[args.baseline])
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
