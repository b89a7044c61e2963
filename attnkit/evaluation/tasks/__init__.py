"""Bundled offline lm-eval tasks: YAML templates here, their data in `data/` (see build.py)."""

from __future__ import annotations

from pathlib import Path

from attnkit.errors import AttnkitError

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
RECALL_LENGTHS = (256, 512, 1024)
RECALL = [f"attnkit-recall-{n}" for n in RECALL_LENGTHS]
BUNDLED = ["attnkit-ppl", "attnkit-complete", *RECALL]
GROUPS = {"attnkit-core": BUNDLED, "attnkit-recall": RECALL}


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


def check_names(names: list[str]) -> None:
    """Refuse a misspelt attnkit task at once (other names are checked against lm-eval's index)."""
    stray = [n for n in names if n.startswith("attnkit-") and n not in BUNDLED]
    if stray:
        raise AttnkitError(f"unknown task {stray[0]!r} (bundled: {', '.join(BUNDLED)}, attnkit-core)")


def render(names: list[str], folder: Path) -> None:
    """Write the YAML of each bundled task in `names` into `folder`, data paths made absolute."""
    for name in names:
        if name not in BUNDLED:
            continue
        if name.startswith("attnkit-recall-"):
            template, length = (HERE / "attnkit-recall.yaml").read_text(), name.rsplit("-", 1)[1]
        else:
            template, length = (HERE / f"{name}.yaml").read_text(), ""
        text = template.replace("{data}", DATA.as_posix()).replace("{length}", length)
        (folder / f"{name}.yaml").write_text(text)
