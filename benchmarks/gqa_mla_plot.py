"""Perplexity against KV-cache bytes per token: fewer KV heads (`convert --to gqa`) and MLA
(`convert --to mla`), one-shot and healed, one panel per source model (docs/gqa-vs-mla.md).

    python benchmarks/gqa_mla_plot.py out/g15/*/finetune_report.json out/g15/*.eval.json \\
        -o docs/img/gqa-vs-mla.png [--metric attnkit-ppl/token_perplexity]

Inputs are reports, not numbers typed in:
* `finetune_report.json` of a healed conversion: its `eval_before` is the one-shot point, `eval_after`
  the healed one; the conversion (family, KV bytes, source) is read from the `attnkit_report.json` of
  its `base_model_path`.
* `attnkit eval --out FILE.json` of a conversion (a one-shot point, e.g. an unhealed `--merge mean`)
  or of a source model (no `attnkit_report.json` beside it: the panel's 100 % point and dotted line).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Point:
    source: str  # panel: the source model's folder name
    family: str  # "source", "GQA aligned", "GQA mean", "MLA", "MLA, transformers form"
    state: str  # "one-shot" | "healed" | "source"
    kv_bytes: int  # per token, all layers, in the report's dtype
    ppl: float
    label: str  # what to print beside the point (KV heads, or r/d_r)


def _metric(results: dict, metric: str) -> float | None:
    task, name = metric.split("/")
    return (results.get(task) or {}).get(name)


def _conversion(folder: Path) -> dict | None:
    report = folder / "attnkit_report.json"
    return json.loads(report.read_text()) if report.is_file() else None


def _folder(report: Path, value: str) -> Path:
    """A model folder a report names: absolute (older reports), or relative to the report's own folder
    (attnkit writes local paths that way), else as given (relative to the working directory)."""
    folder = Path(value)
    if folder.is_absolute():
        return folder
    beside = Path(report).parent / folder
    return beside if beside.is_dir() else folder


def _describe(conv: dict) -> tuple[str, str, str]:
    """(source name, family, short label) of a convert report."""
    source = Path(conv["source"]["path"]).name
    t = conv["target"]
    if conv["method"] == "gqa":
        return source, f"GQA {t['merge']}", f"{t['num_key_value_heads']} KV"
    family = "MLA, transformers form" if t.get("form") == "transformers" else "MLA"
    return source, family, f"{t['kv_lora_rank']}/{t['qk_rope_head_dim']}"


def points_of(path: Path, data: dict, metric: str) -> list[Point]:
    """The points one report contributes (pure: the conversion report is read by the caller's helper)."""
    if "eval_after" in data:  # finetune_report.json
        conv = _conversion(_folder(path, data["base_model_path"]))
        if conv is None:
            return []
        source, family, label = _describe(conv)
        kv = conv["kv_cache_bytes_per_token"]["after"]
        out = []
        for state, key in (("one-shot", "eval_before"), ("healed", "eval_after")):
            ppl = _metric(data.get(key) or {}, metric)
            if ppl is not None:
                out.append(Point(source, family, state, kv, ppl, label))
        return out
    model = data["models"]["model"]
    ppl = _metric(model["metrics"], metric)
    conv = _conversion(_folder(path, model["path"]))
    if ppl is None:
        return []
    if conv is None:
        return [Point(Path(model["path"]).name, "source", "source", model["kv_cache_bytes_per_token"], ppl, "source")]
    source, family, label = _describe(conv)
    return [Point(source, family, "one-shot", conv["kv_cache_bytes_per_token"]["after"], ppl, label)]


STYLE = {"GQA aligned": ("tab:blue", "o"), "GQA mean": ("tab:gray", "v"), "MLA": ("tab:red", "s"),
         "MLA, transformers form": ("tab:orange", "D")}


def plot(points: list[Point], out: Path, metric: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    sources = sorted({p.source for p in points})
    fig, axes = plt.subplots(1, len(sources), figsize=(6.2 * len(sources), 4.6), squeeze=False)
    for ax, source in zip(axes[0], sources):
        mine = [p for p in points if p.source == source]
        src = [p for p in mine if p.state == "source"]
        for p in src:
            ax.axhline(p.ppl, color="black", lw=0.8, ls=":")
            ax.plot([p.kv_bytes], [p.ppl], "k*", ms=10, label=f"source {p.ppl:.2f}")
        for family, (color, marker) in STYLE.items():
            for state, ls, fill in (("one-shot", "--", "none"), ("healed", "-", color)):
                pts = sorted((p for p in mine if p.family == family and p.state == state), key=lambda p: p.kv_bytes)
                if not pts:
                    continue
                xs, ys = [p.kv_bytes for p in pts], [p.ppl for p in pts]
                ax.plot(xs, ys, ls=ls, color=color, marker=marker, mfc=fill, label=f"{family}, {state}")
                for p in pts:
                    ax.annotate(p.label, (p.kv_bytes, p.ppl), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(source)
        ax.set_xlabel("KV cache bytes per token (all layers, bf16)")
        ax.set_ylabel(metric.replace("/", " "))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", type=Path, help="finetune_report.json and attnkit eval --out files")
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--metric", default="attnkit-ppl/token_perplexity", help="TASK/METRIC (default: %(default)s)")
    args = ap.parse_args()
    points = [p for path in args.reports for p in points_of(path, json.loads(path.read_text()), args.metric)]
    points = list(dict.fromkeys(points))  # a healed run's eval_before and an eval JSON of its student agree
    for p in sorted(points, key=lambda p: (p.source, p.family, p.state, p.kv_bytes)):
        print(f"{p.source:16s} {p.family:12s} {p.state:9s} {p.kv_bytes:6d} B/token  {p.ppl:9.3f}  {p.label}")
    plot(points, args.out, args.metric)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
