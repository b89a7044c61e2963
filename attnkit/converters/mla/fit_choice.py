"""`--kv-budget F --fit-steps N --choose-by fit`: the split whose fitted conversion measures the least KL.

The KL search ranks splits by the closed form, before the layer fit. Fitted, they rank differently,
and not always in the same direction: on reference-c (8/2 heads of 32) at 38 values per token and
layer, the closed form picks 18/20 and the fit ranks 26/12 (KL 0.053) and 22/16 (0.055) before it (0.072);
healed with the recipe they reach x1.067 / x1.073 / x1.086 of the source. On the reference (8/2 heads of
64) the closed form's 36/40 stays the best fitted split (0.013 against 0.015 for 44/32). So the fitted
KL is measured, not assumed: a walk along rope_dim at a constant number of cached values, from the KL
choice to its better fitted neighbour, until both neighbours of the best fit worse (docs/finetune.md).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from attnkit.converters.mla.choice import REPORT, Split, Tried, budget_section, choose, chosen_split, least
from attnkit.errors import AttnkitError


def check(args: argparse.Namespace) -> None:
    if args.kv_budget is None:
        raise AttnkitError("--choose-by fit chooses among --kv-budget's splits; give --kv-budget F")
    if not getattr(args, "fit_steps", 0):
        raise AttnkitError("--choose-by fit ranks splits by the layer fit's KL; give --fit-steps N (e.g. 200)")
    if getattr(args, "engine_sizes", None):
        raise AttnkitError("--choose-by fit walks along rope_dim, which --engine-sizes fixes at 64; use "
                           "--choose-by kl with --engine-sizes")
    if args.fit_candidates < 1:
        raise AttnkitError("--fit-candidates must be at least 1")


def walk_step(rope_dim: int) -> int:
    """The rope_dim step between two splits the walk compares: a tenth of the KL choice's key, twice (even),
    at least 2 (reference-c 20 -> 4, reference 40 -> 8, reference-mha 64 -> 12)."""
    return max(2, 2 * round(rope_dim / 10))


def next_split(budget: dict, tried: list[Tried], limit: int) -> Split | None:
    """The KL choice first; then the best fitted split's untried neighbour, narrower RoPE key first (the
    latent's channels are what the fit re-learns best), wider second; None when both were tried, fall
    outside the KL search's range of rope dims, or `limit` splits were converted. Every split keeps the
    KL choice's kv_lora_rank + rope_dim cached values."""
    rank, rope = chosen_split(budget)
    if not tried:
        return rank, rope
    if len(tried) >= limit:
        return None
    step, values = walk_step(rope), rank + rope
    widest = max(row["rope_dim"] for row in budget["candidates"])
    seen = {t.split[1] for t in tried}
    best = least(tried).split[1]
    for d in (best - step, best + step):
        if d not in seen and 2 <= d <= widest and values - d >= 2:
            return values - d, d
    return None


def fitted_kl(folder: Path) -> float:
    """KL(source || written model) on the conversion's held-out rows: its report's last step."""
    steps = json.loads((folder / REPORT).read_text())["steps"]
    return float(next(s for s in steps if s["name"] == "native")["kl"])


def choose_by_fit(args: argparse.Namespace, convert_one: Callable[[argparse.Namespace], int],
                  tmp: Path) -> tuple[dict, str]:
    """Fill `tmp` (the output's temporary folder) with the split of least fitted KL; returns the report's
    `kv_budget` section with every split fitted, and a line saying what was chosen."""
    def propose(budget: dict, tried: list[Tried]) -> Split | None:
        split = next_split(budget, tried, args.fit_candidates)
        if split is not None:
            print(f"--choose-by fit: fitting {split[0]}/{split[1]} ({len(tried) + 1} of at most "
                  f"{args.fit_candidates}) …", flush=True)
        return split

    def score(folder: Path, split: Split, kl: float | None) -> tuple[float, dict]:
        fitted = fitted_kl(folder)
        print(f"--choose-by fit: {split[0]}/{split[1]} fitted KL {fitted:.4f}", flush=True)
        return fitted, {"fitted_kl": fitted}

    budget, tried = choose(args, convert_one, tmp, "fit", propose, score)
    section = budget_section(budget, tried, "fit", {"fit_steps": args.fit_steps, "step": walk_step(budget["chosen"]["rope_dim"])})
    chosen = section["chosen"]
    return section, (f"--choose-by fit: chose kv_lora_rank {chosen['kv_lora_rank']}, rope_dim {chosen['rope_dim']} "
                     f"({len(tried)} splits fitted, {args.fit_steps} fit steps each)")
