"""`--kv-budget F --choose-by heal`: of the splits with the least one-shot KL, the one that heals best.

One-shot KL tells splits far apart correctly but not near-ties. On reference-mha at 30 % of the cache,
255/52, 249/58 and 243/64 all measure KL 0.1505; the least of them (255/52) heals to x1.078 of the source
where 243/64 heals to x1.068 (docs/finetune.md, "Which split heals best"). `--kv-budget` alone now breaks
such ties by RoPE width (`budget.preferred`); a short heal of each finalist (12 steps of the recipe, about a
quarter of its tokens), which ranked four splits as the full heals did, measures instead of assuming. This
module runs it: convert the finalists, heal each briefly in its own process, keep the conversion whose heal
ended lowest.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from attnkit.converters.mla.budget import preferred
from attnkit.converters.mla.choice import Split, Tried, budget_section, choose
from attnkit.errors import AttnkitError


def finalists(candidates: list[dict], k: int) -> list[dict]:
    """The k rows of the --kv-budget table it ranks first (`budget.preferred`: the least KL, ties by RoPE width)."""
    return preferred(candidates)[:k]


def short_heal_command(recipe: str, model: Path, teacher: str, work: Path, steps: int) -> list[str]:
    """`attnkit finetune` of `model` for `steps` optimizer steps, only the final validation loss measured."""
    return [sys.executable, "-m", "attnkit.cli", "finetune", "--config", recipe, f"model={model}",
            f"teacher={teacher}", f"output_dir={work / 'healed'}", f"run_dir={work / 'run'}",
            f"train.max_steps={steps}", "eval.tasks=null", "eval.every=0", "checkpoint.every=0",
            "log.tensorboard=false"]


def short_heal(recipe: str, model: Path, teacher: str, work: Path, steps: int) -> float:
    """Validation loss after a short heal (in a child process: each finalist starts from a clean memory)."""
    proc = subprocess.run(short_heal_command(recipe, model, teacher, work, steps), capture_output=True, text=True)
    report = work / "healed" / "finetune_report.json"
    if proc.returncode != 0 or not report.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise AttnkitError(f"--choose-by heal: the short heal of {model.name} failed ({last})")
    return float(json.loads(report.read_text())["eval_after"]["validation"]["loss"])


def check_recipe(args: argparse.Namespace) -> str:
    if args.kv_budget is None:
        raise AttnkitError("--choose-by heal chooses among --kv-budget's splits; give --kv-budget F")
    if not Path(args.heal_recipe).is_file():
        raise AttnkitError(f"--heal-recipe {args.heal_recipe}: no such file (the healing recipe the finalists are "
                           f"healed with, e.g. recipes/heal-mla.yaml of the attnkit repository)")
    if args.heal_steps < 1 or args.heal_candidates < 1:
        raise AttnkitError("--heal-steps and --heal-candidates must be at least 1")
    return str(Path(args.heal_recipe).resolve())


def choose_by_heal(args: argparse.Namespace, convert_one: Callable[[argparse.Namespace], int],
                   tmp: Path, recipe: str, teacher: str) -> tuple[dict, str]:
    """Fill `tmp` (the output's temporary folder) with the finalist that healed best; returns the report's
    `kv_budget` section with the finalists' heals, and a line saying what was chosen. `convert_one`: the plain
    conversion (`convert.convert`); `recipe`: what `check_recipe` returned."""
    def propose(budget: dict, tried: list[Tried]) -> Split | None:
        rows = finalists(budget["candidates"], args.heal_candidates)
        return (rows[len(tried)]["kv_lora_rank"], rows[len(tried)]["rope_dim"]) if len(tried) < len(rows) else None

    def score(folder: Path, split: Split, kl: float | None) -> tuple[float, dict]:
        print(f"--choose-by heal: healing {split[0]}/{split[1]} for {args.heal_steps} steps …", flush=True)
        healed = folder.parent / f"heal-r{split[0]}_dr{split[1]}"
        loss = short_heal(recipe, folder, teacher, healed, args.heal_steps)
        shutil.rmtree(healed)
        print(f"--choose-by heal: {split[0]}/{split[1]} (KL {kl:.4f}) -> validation loss {loss:.4f} "
              f"after {args.heal_steps} steps")
        return loss, {"heal_validation_loss": loss}

    budget, tried = choose(args, convert_one, tmp, "heal", propose, score)
    section = budget_section(budget, tried, "heal", {"recipe": Path(args.heal_recipe).name, "steps": args.heal_steps})
    chosen = section["chosen"]
    return section, (f"--choose-by heal: chose kv_lora_rank {chosen['kv_lora_rank']}, rope_dim {chosen['rope_dim']} "
                     f"({len(tried)} finalists, {args.heal_steps} steps of {Path(args.heal_recipe).name} each)")
