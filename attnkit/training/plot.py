"""Retention vs healing tokens from finetune_report.json files (PNG), for comparing recipes.

    python -m attnkit.training.plot out/a out/b ... -o docs/img/heal-retention.png [--labels a,b]

Retention = teacher perplexity ÷ student perplexity on the held-out validation rows (1.0 = the
source model's quality), read from each report's `eval_curve` ([step, tokens, val loss]) and
`eval_teacher`; the point at 0 tokens is `eval_before`.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from attnkit.errors import AttnkitError


def retention_curve(report: dict) -> list[tuple[int, float]]:
    """[(tokens seen, teacher ppl / student ppl)] — needs a run that distilled or named a teacher."""
    teacher = (report.get("eval_teacher") or {}).get("validation", {}).get("loss")
    before = (report.get("eval_before") or {}).get("validation", {}).get("loss")
    if teacher is None or before is None:
        raise AttnkitError("report has no teacher/before validation loss (run with a teacher)")
    points = [(0, math.exp(teacher - before))]
    points += [(int(tokens), math.exp(teacher - loss)) for _, tokens, loss in report.get("eval_curve", [])]
    return points


def plot(folders: list[Path], labels: list[str], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for folder, label in zip(folders, labels):
        path = folder / "finetune_report.json" if folder.is_dir() else folder
        if not path.is_file():
            raise AttnkitError(f"{path} not found")
        xs, ys = zip(*retention_curve(json.loads(path.read_text())))
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("healing tokens")
    ax.set_ylabel("perplexity retention (source ppl / healed ppl)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="output folders (or finetune_report.json files)")
    p.add_argument("-o", "--out", type=Path, required=True)
    p.add_argument("--labels", default=None, help="comma-separated legend labels")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [r.name for r in args.runs]
    if len(labels) != len(args.runs):
        p.error("--labels needs one label per run")
    try:
        print(plot(args.runs, labels, args.out))
    except AttnkitError as exc:
        print(f"attnkit: error: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
