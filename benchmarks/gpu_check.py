"""What only a GPU shows, as one prepared run for a lent GPU machine: what is installed there, the
Llama-3.2-1B-shaped `attnkit convert --to mla --device cuda`, and FSDP healing steps on the GPU in bf16.

    python benchmarks/gpu_check.py --out "$OUT"                                        # on the GPU machine
    python benchmarks/gpu_check.py --out /tmp/gc --device cpu --layers 2 --steps 1     # the same plumbing, on a CPU

Nothing is installed or downloaded: the machine's own Python must have torch, transformers, accelerate,
safetensors and tokenizers (the first part lists what is missing and stops there if one of those is). attnkit
runs from this checkout (PYTHONPATH). Parts, each under its own time limit, OUT/gpu_check.json rewritten after
each (a run cut short still reports what it reached):

1. environment: Python, torch and CUDA, the GPUs, the versions of attnkit's dependencies, `nvidia-smi`;
2. convert: `benchmarks/convert_memory.py --defaults --keep --extra "--device D --report final"` (the random
   1B-shaped source built tensor by tensor): wall time, peak host RSS, peak GPU memory (nvidia-smi, sampled);
3. heal: `accelerate launch --config_file recipes/accelerate/fsdp.yaml --num_processes N` of
   `recipes/heal-mla.yaml` on that conversion (its teacher: the source), with the file's bf16 on CUDA and fp32
   on a CPU, through `fsdp_cpu.launch` and its probe: losses, seconds, per-process host peaks and
   `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("torch", "transformers", "accelerate", "safetensors", "tokenizers")
ALSO = ("peft", "huggingface_hub", "tqdm", "pyyaml", "numpy", "lm_eval", "matplotlib", "hypothesis", "pytest")


def environment() -> dict:
    """Versions and devices; `missing` names the packages attnkit cannot run without."""
    versions = {}
    for name in NEEDED + ALSO:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    env = {"python": sys.version.split()[0], "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "versions": versions, "missing": [n for n in NEEDED if versions[n] is None]}
    if versions["torch"]:
        import torch

        env["torch_cuda"] = torch.version.cuda
        env["gpus"] = [{"name": torch.cuda.get_device_name(i),
                        "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                       for i in range(torch.cuda.device_count())]
        env["bf16"] = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    smi = shutil.which("nvidia-smi")
    env["nvidia_smi"] = subprocess.run([smi], capture_output=True, text=True).stdout[-3000:] if smi else None
    return env


class GpuMemory(threading.Thread):
    """The largest `memory.used` (MiB) nvidia-smi reports per GPU while it runs, sampled every 0.5 s: the
    whole device's use, every process on it included (torch's own counters see one process only)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak: list[int] | None = None
        self.running = shutil.which("nvidia-smi") is not None

    def run(self) -> None:
        while self.running:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout.split()
            used = [int(x) for x in out if x.isdigit()]
            self.peak = used if self.peak is None else [max(a, b) for a, b in zip(self.peak, used)]
            time.sleep(0.5)

    def __enter__(self) -> GpuMemory:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.running = False


def convert(work: Path, device: str, layers: int | None, timeout: int) -> dict:
    """The 1B-shaped MLA conversion on `device` (convert_memory.py), its JSON and the GPU peak."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "convert_memory.py"), "--work", str(work), "--keep", "--defaults",
           *(["--layers", str(layers)] if layers else []), "--extra", f"--device {device} --report final"]
    began = time.perf_counter()
    with GpuMemory() as gpu:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    result = {"command": " ".join(cmd[1:]), "returncode": proc.returncode,
              "seconds": round(time.perf_counter() - began, 1), "gpu_memory_used_peak_mib": gpu.peak}
    if proc.returncode == 0:
        result["convert_memory"] = json.loads((work / "convert_memory.json").read_text())
    else:
        result["stderr_tail"] = proc.stderr[-4000:]
    return result


def heal(work: Path, procs: int, steps: int, cuda: bool, timeout: int) -> dict:
    """FSDP healing steps of the conversion under recipes/accelerate/fsdp.yaml (bf16 on CUDA, as the file says)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fsdp_cpu

    overrides = [f"model={work / 'out'}", f"train.max_steps={steps}", "data.seq_len=1024", "train.per_device_batch_size=1",
                 f"data.val_tokens={1024 * procs}", "eval.tasks=null", "eval.every=0", "log.tensorboard=false",
                 "checkpoint.every=0"]
    with GpuMemory() as gpu:
        run = fsdp_cpu.launch("fsdp", work, "heal", overrides, procs=procs, timeout=timeout,
                              mixed_precision="bf16" if cuda else "no", env_extra=fsdp_cpu.ENV)
    run["gpu_memory_used_peak_mib"] = gpu.peak
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where gpu_check.json and the work folder go")
    parser.add_argument("--device", default="cuda", help="convert's --device (cpu: try the plumbing here)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of the 1B shape (default 16)")
    parser.add_argument("--steps", type=int, default=2, help="healing steps")
    parser.add_argument("--procs", type=int, default=None, help="FSDP processes (default: the GPU count, or 1)")
    parser.add_argument("--convert-timeout", type=int, default=300)
    parser.add_argument("--heal-timeout", type=int, default=240)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    report: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv])}

    def save(part: str, value) -> None:
        report[part] = value
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        print(f"gpu_check: {part} done", flush=True)

    env = environment()
    save("environment", env)
    if env["missing"]:
        raise SystemExit(f"gpu_check: missing {', '.join(env['missing'])}; nothing else run")
    cuda = args.device.startswith("cuda")
    if cuda and not env.get("gpus"):
        raise SystemExit("gpu_check: --device cuda but torch sees no GPU; nothing else run")
    save("convert", convert(work, args.device, args.layers, args.convert_timeout))
    if report["convert"]["returncode"] != 0:
        raise SystemExit("gpu_check: the conversion failed; see gpu_check.json")
    procs = args.procs or max(1, len(env.get("gpus") or []))
    save("heal", heal(work, procs, args.steps, cuda, args.heal_timeout))


if __name__ == "__main__":
    main()
