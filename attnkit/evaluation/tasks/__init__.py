"""Bundled offline lm-eval tasks: ready YAMLs in this folder, their data in `data/` (see build.py).

The YAMLs load their data through `attnkit_data.py` beside them (`custom_dataset: !function`),
which lm-eval imports by path, so this very folder is what `attnkit tasks path` prints and what
`lm_eval --include_path` takes: nothing is rendered or copied.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from attnkit.errors import AttnkitError

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
RECALL_LENGTHS = (256, 512, 1024)
RECALL = [f"attnkit-recall-{n}" for n in RECALL_LENGTHS]
BUNDLED = ["attnkit-ppl", "attnkit-complete", *RECALL]
QUICK = ["attnkit-ppl-quick", "attnkit-complete-quick", "attnkit-recall-256"]
DISTRACT = [f"attnkit-distract-{d}" for d in ("near", "mid", "far")]  # a needle among look-alike decoys (distract.py)
GROUPS = {"attnkit-core": BUNDLED, "attnkit-recall": RECALL, "attnkit-quick": QUICK, "attnkit-distract": DISTRACT}
FAR = ["attnkit-recall-far"]  # the needle beyond a 64/128-token window (Titans / window retrofits)
TASKS = [*BUNDLED, *(t for t in QUICK if t not in BUNDLED), *FAR, *DISTRACT]  # every bundled task name
DEFAULT = "attnkit-quick"  # what `attnkit eval` runs without --tasks; recipes name attnkit-core


def expand(spec: str) -> list[str]:
    """`attnkit-core,hellaswag` → ['attnkit-ppl', …, 'hellaswag'] (order kept, duplicates dropped)."""
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        for name in GROUPS.get(item, [item]):
            if name not in names:
                names.append(name)
    if not names:
        raise AttnkitError("no task given (--tasks is empty)")
    return names


def known_names() -> str:
    """Every bundled group and task, for "unknown task" messages."""
    return ", ".join([*GROUPS, *TASKS])


def check_names(names: list[str]) -> None:
    """Refuse a misspelt attnkit task at once (other names are checked against lm-eval's index)."""
    stray = [n for n in names if n.startswith("attnkit-") and n not in TASKS]
    if stray:
        raise AttnkitError(f"unknown task {stray[0]!r} (bundled: {known_names()})")


def check_names_without_index(names: list[str]) -> None:
    """`check_names`, and a name that no lm-eval task file mentions at all refused too: a text scan of
    lm-eval's task YAMLs (a second or so), not its task index (minutes on a busy CPU), so that
    `convert --eval` can refuse a misspelt task before converting. A name the scan finds may still be
    refused later by the index (a word that is not a task)."""
    import re

    check_names(names)
    others = [n for n in names if n not in TASKS]
    if not others:
        return
    try:
        import lm_eval
    except ImportError:
        return
    root = Path(lm_eval.__file__).resolve().parent / "tasks"
    patterns = {n: re.compile(rf"(?<![\w.-]){re.escape(n)}(?![\w.-])") for n in others}
    missing = set(others)
    for path in root.rglob("*.y*ml"):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        missing -= {n for n in missing if n in text and patterns[n].search(text)}
        if not missing:
            return
    first = next(n for n in others if n in missing)
    raise AttnkitError(f"unknown task {first!r}: not bundled ({known_names()}) and no lm-eval task or group of that name")


class _TagLoader(yaml.SafeLoader):
    """Reads lm-eval task YAMLs without importing anything: `!function x.y` stays the string 'x.y'."""


_TagLoader.add_multi_constructor("!", lambda loader, tag, node: loader.construct_scalar(node))


def task_config(name: str) -> dict[str, Any]:
    """The YAML of bundled task `name`, with its `include` merged (lm-eval's rule: the task's keys win)."""
    path = HERE / f"{name}.yaml"
    config = yaml.load(path.read_text(), Loader=_TagLoader)
    base = config.pop("include", None)
    if base:
        parent = yaml.load((HERE / base).read_text(), Loader=_TagLoader)
        parent.pop("include", None)
        config = {**parent, **config}
    return config


def items(name: str, limit: int | None = None) -> list[dict]:
    """The documents lm-eval evaluates for bundled task `name` (its first `limit` with --limit)."""
    from attnkit.evaluation.tasks.attnkit_data import read

    kwargs = task_config(name)["dataset_kwargs"]
    docs = read(kwargs["file"], kwargs.get("rows"))
    return docs if limit is None else docs[:limit]


def work_estimate(names: list[str], tokenizer: Any, limit: int | None, max_length: int) -> int:
    """Tokens the forward passes will process for the bundled tasks in `names` (progress-bar units).

    Close to what `SharedPrefixLM` counts (each context once, then each choice's tokens); other
    lm-eval tasks count 0 here and are added to the bar's total when their requests arrive.
    """
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    total = 0
    for name in (n for n in names if n in TASKS):
        for doc in items(name, limit):
            if "text" in doc:  # rolling windows of max_length, each scored in one pass
                total += count(doc["text"])
                continue
            ctx, choices = count(doc["context"]), [count(c) for c in doc["choices"]]
            total += min(ctx, max_length) + len(choices) * max(max(choices) - 1, 0)
    return total


def main(args: argparse.Namespace) -> int:
    """`attnkit tasks path`: print the folder lm-eval's --include_path takes."""
    print(HERE)
    return 0
