"""Wall time and peak RSS of `attnkit convert` against the source's parameters, per method, from the runs
`benchmarks/convert_memory.py --results FILE` merged into FILE.

    python benchmarks/plot_convert_memory.py [benchmarks/results/convert_memory.json] [-o docs/img/convert_memory.png]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def series(runs: list[dict]) -> dict[str, list[tuple[int, float, float]]]:
    """method -> [(parameters, wall seconds or None, peak GB)] sorted by parameters."""
    out: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for r in runs:
        out[r["method"]].append((r["source_params"], r["wall_time_s"], r["peak_rss_bytes"] / 1e9))
    return {m: sorted(points, key=lambda point: point[0]) for m, points in sorted(out.items())}


def plot(runs: list[dict], png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for method, points in series(runs).items():
        params = [p for p, _, _ in points]
        timed = [(p, t) for p, t, _ in points if t is not None]  # a run paused by hand has no time
        left.plot([p for p, _ in timed], [t / 60 for _, t in timed], "o-", label=method)
        right.plot(params, [g for _, _, g in points], "o-", label=method)
    sizes = sorted({r["source_params"]: r["source_bytes"] for r in runs}.items())
    right.plot([p for p, _ in sizes], [b / 1e9 for _, b in sizes], "k--", lw=0.8, label="checkpoint size")
    for ax, title in ((left, "wall time (min), 2 CPU cores"), (right, "peak RSS (GB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("source parameters")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle("attnkit convert: time and peak memory against model size")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    return png


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", default=str(ROOT / "benchmarks" / "results" / "convert_memory.json"))
    ap.add_argument("-o", "--out", default=str(ROOT / "docs" / "img" / "convert_memory.png"))
    args = ap.parse_args()
    runs = json.loads(Path(args.results).read_text())["runs"]
    print(f"wrote {plot(runs, Path(args.out))}")


if __name__ == "__main__":
    main()
