"""Needle recall against the needle's distance, for several models on the same items: JSON, a table and a plot.

    python benchmarks/recall_distance.py MODEL [MODEL ...] [--distances 256,512,1024,2048] [--items 60]
        [--labels a,b,...] [--out recall_distance.json] [--plot recall_distance.png]

Items are built as `attnkit-recall-far`'s (`attnkit/evaluation/tasks/build.py: recall_far_items`): a few
lines of held-out code, a `name = "value"` line, code up to the drawn distance, `assert name == "`, and
four values to choose from (three never seen). Distance D draws from [0.875 D, 1.125 D] tokens between the
needle's end and the answer. Every model answers the same items (scored as `recall_paired.py` does);
accuracies carry 95 % Wilson intervals; chance is 0.25.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from recall_paired import correct, wilson
from transformers import AutoTokenizer

from attnkit.data import iter_documents, shuffled
from attnkit.evaluation.tasks.build import recall_far_items


def items_at(tokenizer, distance: int, n: int, seed: int) -> list[dict]:
    """n needle items with the needle about `distance` tokens back (held-out files, seeded)."""
    docs = shuffled(list(iter_documents("python", "validation")), seed)
    span = (int(distance * 0.875), int(distance * 1.125))
    return recall_far_items(docs, tokenizer, n, random.Random(seed + distance), per_doc=2, distance=span)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rows in result["models"].items():
        xs = [r["distance"] for r in rows]
        ax.errorbar(xs, [r["acc"] for r in rows], marker="o", capsize=3, label=label,
                    yerr=[[r["acc"] - r["wilson95"][0] for r in rows], [r["wilson95"][1] - r["acc"] for r in rows]])
    ax.axhline(0.25, color="grey", linestyle=":", label="chance")
    ax.set_xscale("log", base=2)
    ax.set_xticks(result["distances"], [str(d) for d in result["distances"]])
    ax.set_xlabel("tokens between the needle and the question")
    ax.set_ylabel("recall (4 choices)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--distances", default="256,512,1024,2048")
    ap.add_argument("--items", type=int, default=60, help="items per distance")
    ap.add_argument("--labels", help="comma-separated names for the models (default: their folder names)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", type=Path, default=Path("recall_distance.json"))
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    labels = args.labels.split(",") if args.labels else [Path(m).name for m in args.models]
    distances = [int(d) for d in args.distances.split(",")]
    from attnkit.io.resolve import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.models[0]))
    items = {d: items_at(tokenizer, d, args.items, args.seed) for d in distances}
    result = {"distances": distances, "items": {d: len(v) for d, v in items.items()}, "models": {}}
    for label, model in zip(labels, args.models):
        got = correct(model, [it for d in distances for it in items[d]])
        rows, at = [], 0
        for d in distances:
            part, at = got[at:at + len(items[d])], at + len(items[d])
            rows.append({"distance": d, "n": len(part), "acc": sum(part) / len(part),
                         "wilson95": list(wilson(sum(part), len(part))), "correct": [int(x) for x in part]})
        result["models"][label] = rows
    print(f"{'model':24s}" + "".join(f"{d:>16}" for d in distances))
    for label, rows in result["models"].items():
        print(f"{label:24s}" + "".join(f"{r['acc']:>9.3f} (n {r['n']:>3})" for r in rows))
    args.out.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
