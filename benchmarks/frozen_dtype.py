"""Healing with the frozen weights held in bf16 is the same training as in fp32, method by method.

For each method, the bundled reference (stored in bf16) is converted, a copy of the converted model is written
with every tensor in fp32 (the same values), and both are healed for a few steps with the method's recipe.
The bf16 one is held in bf16 (its frozen parameters and the whole teacher, `attnkit/training/frozen.py`), the
fp32 copy in fp32: the loss curves and the healed weights must be equal.

    python benchmarks/frozen_dtype.py [--work /tmp/attnkit-frozen] [--methods mla,diff,dex,titans,gqa]
        [--steps 3] [-o benchmarks/results/frozen_dtype.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

METHODS = {  # conversion arguments and recipe
    "mla": (["--to", "mla", "reference", "--kv-lora-rank", "28", "--rope-dim", "48"], "recipes/heal-mla.yaml"),
    "diff": (["--to", "diff", "reference"], "recipes/heal-diff.yaml"),
    "dex": (["--to", "dex", "reference", "--heads", "auto"], "recipes/heal-dex.yaml"),
    "titans": (["--to", "titans", "reference", "--window", "128"], "recipes/heal-titans.yaml"),
    "gqa": (["--to", "gqa", "reference", "--kv-heads", "1"], "recipes/heal-gqa.yaml"),
}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def attnkit(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "attnkit.cli", *args], env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"attnkit {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done


def fp32_copy(src: Path, dst: Path) -> Path:
    """The same model with every tensor stored in fp32 (exact: bf16 → fp32)."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        save_file({k: v.float() for k, v in load_file(str(shard)).items()}, str(shard), metadata={"format": "pt"})
    return dst


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in folder.glob("*.safetensors"):
        out.update(load_file(str(shard)))
    return out


def check(method: str, work: Path, steps: int) -> dict:
    convert_args, recipe = METHODS[method]
    held = work / method
    attnkit("convert", *convert_args, "-o", str(held), "--force")
    runs = {}
    for name, model in (("bf16", held), ("fp32", fp32_copy(held, work / f"{method}-fp32"))):
        out = work / f"{method}-{name}-healed"
        began = time.perf_counter()
        attnkit("finetune", "--config", recipe, f"model={model}", f"output_dir={out}", f"train.max_steps={steps}",
                "eval.tasks=null", "eval.every=0", "checkpoint.every=0", "log.tensorboard=false",
                "data.tokens=8192", "data.val_tokens=2048", "force=true")
        report = json.loads((out / "finetune_report.json").read_text())
        runs[name] = {"seconds": round(time.perf_counter() - began, 1), "loss_curve": report["loss_curve"],
                      "notes": [n for n in report.get("notes", []) if "held in" in n]}
    a, b = weights(work / f"{method}-bf16-healed"), weights(work / f"{method}-fp32-healed")
    return {"convert": " ".join(["attnkit", "convert", *convert_args]), "recipe": recipe, "runs": runs,
            "same_losses": runs["bf16"]["loss_curve"] == runs["fp32"]["loss_curve"],
            "same_weights": a.keys() == b.keys() and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/attnkit-frozen")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("-o", "--output", default="benchmarks/results/frozen_dtype.json")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = {m: check(m, work, args.steps) for m in args.methods.split(",")}
    print(f"{'method':8} {'same losses':>12} {'same weights':>13}  bf16-held notes")
    for m, r in results.items():
        print(f"{m:8} {str(r['same_losses']):>12} {str(r['same_weights']):>13}  {'; '.join(r['runs']['bf16']['notes'])}")
    Path(args.output).write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "steps": args.steps,
                                             "methods": results}, indent=2))
    print(f"wrote {args.output}")
    if not all(r["same_losses"] and r["same_weights"] for r in results.values()):
        raise SystemExit("a method trains differently with its frozen weights held in bf16")


if __name__ == "__main__":
    main()
