"""Split choices measured on whole conversions (`--choose-by heal`, `--choose-by fit`).

The closed form's KL ranks splits before any training. When something trains the converted model
afterwards (a short heal, the layer fit), the split that ends best is not always the one that starts
best, so these choices convert the splits a rule proposes, score each conversion, and keep the least.
The rule and the score are the method's (`heal_choice`, `fit_choice`); this module only runs them:
the KL choice converted first, then each proposed split into a scratch folder, at most two conversions
on disk at once (the best so far and the one being scored), the best moved into the output at the end.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPORT = "attnkit_report.json"

Split = tuple[int, int]  # (kv_lora_rank, rope_dim)


@dataclass
class Tried:
    """One split converted and scored (lower is better); `fields` go into the report as they are."""

    split: Split
    score: float
    fields: dict = field(default_factory=dict)
    folder: Path | None = None

    def row(self) -> dict:
        return {"kv_lora_rank": self.split[0], "rope_dim": self.split[1], **self.fields}


# (the --kv-budget section of the KL choice's report, the splits tried so far) -> the next split, or None to stop
Propose = Callable[[dict, list[Tried]], "Split | None"]
# (a converted split's folder, the split, its one-shot KL in the KL search's table or None) -> (score, the fields
# the report lists for it besides that KL)
Score = Callable[[Path, Split, "float | None"], tuple[float, dict]]


def sub_args(args: argparse.Namespace, out: Path, **changes) -> argparse.Namespace:
    """The same conversion into a scratch folder, the split measured by KL or (`changes`) named."""
    ns = copy.copy(args)
    ns.choose_by, ns.out, ns.force, ns.announce = "kl", str(out), False, False
    for key, value in changes.items():
        setattr(ns, key, value)
    return ns


def chosen_split(budget: dict) -> Split:
    return budget["chosen"]["kv_lora_rank"], budget["chosen"]["rope_dim"]


def least(tried: list[Tried]) -> Tried:
    """The split of least score so far."""
    return min(tried, key=lambda t: t.score)


def choose(args: argparse.Namespace, convert_one: Callable[[argparse.Namespace], int], tmp: Path, label: str,
           propose: Propose, score: Score) -> tuple[dict, list[Tried]]:
    """Fill `tmp` (the output's temporary folder) with the proposed split of least score. Returns the KL
    choice's `kv_budget` section and every split tried, in order. `convert_one`: the plain conversion."""
    work = tmp / f".choose-by-{label}"
    first = work / "kl-choice"
    convert_one(sub_args(args, first))
    budget = json.loads((first / REPORT).read_text())["kv_budget"]
    kls = {(r["kv_lora_rank"], r["rope_dim"]): r["kl"] for r in budget["candidates"]}  # the closed form's
    tried: list[Tried] = []
    while (split := propose(budget, tried)) is not None:
        folder = first if split == chosen_split(budget) else work / f"r{split[0]}_dr{split[1]}"
        if folder is not first:
            convert_one(sub_args(args, folder, kv_budget=None, engine_sizes=None, kv_lora_rank=split[0],
                                 rope_dim=split[1]))
        value, fields = score(folder, split, kls.get(split))
        tried.append(Tried(split, value, {"kl": kls.get(split), **fields}, folder))
        best = least(tried)
        for t in tried:
            if t is not best and t.folder is not None and t.folder.exists():
                shutil.rmtree(t.folder)
    for item in best.folder.iterdir():
        shutil.move(str(item), str(tmp / item.name))
    shutil.rmtree(work)
    return budget, tried


def budget_section(budget: dict, tried: list[Tried], label: str, details: dict) -> dict:
    """The written report's `kv_budget`: the KL search's table, the measured choice and how it was made."""
    best = least(tried)
    return {**budget, "chosen": {"kv_lora_rank": best.split[0], "rope_dim": best.split[1]}, "chosen_by": label,
            "kl_chosen": budget["chosen"], f"{label}_choice": {**details, "finalists": [t.row() for t in tried]}}
