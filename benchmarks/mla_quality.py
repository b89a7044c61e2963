"""One-shot quality of `attnkit convert --to mla` against KV-cache size, for both RoPE methods.

    python benchmarks/mla_quality.py MODEL [--fractions 0.25,0.3,0.5,0.75,1.0] [--rope-share 0.25]
        [--methods rorope,partial] [--out docs/mla_quality.json] [--plot docs/mla_ppl_vs_cache.png]
        [--extra "--calib-tokens 32768"]

For every fraction f of the source's KV values per token (2 G d), --rope-dim d_r is the even
number nearest to rope_share * f * 2 G d and --kv-lora-rank is the rest (r + d_r = f * 2 G d).
Each point is one conversion (its report gives held-out perplexity, KL and logits error).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from attnkit.cli import main as cli
from attnkit.io.resolve import load_config, resolve_model


def split_budget(total: int, share: float, G: int, d: int) -> tuple[int, int]:
    """(kv_lora_rank, rope_dim) with rank + rope_dim = total."""
    rope = max(2, min(G * d, 2 * round(share * total / 2)))
    rank = min(total - rope, 2 * G * d - rope + 1)
    return rank, rope


def run_point(model: str, out: Path, rank: int, rope: int, method: str, extra: list[str]) -> dict:
    args = ["convert", "--to", "mla", model, "-o", str(out), "--force", "--kv-lora-rank", str(rank),
            "--rope-dim", str(rope), "--rope-method", method, *extra]
    if cli(args) != 0:
        raise SystemExit(f"conversion failed: {' '.join(args)}")
    return json.loads((out / "attnkit_report.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="MODEL (omit with --merge)")
    ap.add_argument("--merge", default=None, help="comma-separated JSON files of earlier runs: plot them together")
    ap.add_argument("--fractions", default="0.25,0.3,0.5,0.75,1.0")
    ap.add_argument("--rope-share", type=float, default=0.25)
    ap.add_argument("--methods", default="rorope,partial")
    ap.add_argument("--extra", default="", help="more convert arguments, space-separated")
    ap.add_argument("--out", default="docs/mla_quality.json")
    ap.add_argument("--plot", default="docs/mla_ppl_vs_cache.png")
    args = ap.parse_args()
    if args.merge:
        runs = [json.loads(Path(f).read_text()) for f in args.merge.split(",")]
        rows = [p for r in runs for p in r["points"]]
        Path(args.out).write_text(json.dumps({"model": runs[0]["model"], "extra": runs[0]["extra"],
                                              "rope_share": runs[0]["rope_share"], "points": rows}, indent=2))
        plot(rows, args.plot, runs[0]["model"])
        _table(rows)
        return
    cfg = load_config(resolve_model(args.model))
    G = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    full = 2 * G * d
    rows = []
    work = Path(tempfile.mkdtemp(prefix="attnkit-quality-"))
    try:
        for method in args.methods.split(","):
            for f in (float(x) for x in args.fractions.split(",")):
                total = round(f * full)
                rank, rope = split_budget(total, args.rope_share, G, d) if f < 1 else (full - G * d + 1, G * d)
                rep = run_point(args.model, work / "out", rank, rope, method, args.extra.split())
                steps = {s["name"]: s for s in rep["steps"]}
                rows.append({
                    "method": method, "fraction": (rank + rope) / full, "kv_lora_rank": rank, "rope_dim": rope,
                    "ppl_before": rep["ppl"]["before"], "ppl_after": rep["ppl"]["after"],
                    "ppl_ratio": rep["ppl"]["after"] / rep["ppl"]["before"], "kl": steps["native"]["kl"],
                    "logits_rel_err_mean": steps["native"]["logits_rel_err_mean"],
                })
                print(json.dumps(rows[-1]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "extra": args.extra, "rope_share": args.rope_share,
                                          "points": rows}, indent=2))
    plot(rows, args.plot, args.model)
    _table(rows)


def _table(rows: list[dict]) -> None:
    print(f"{'method':<8}{'cache %':>9}{'r':>6}{'d_r':>6}{'ppl x':>9}{'KL':>10}")
    for r in rows:
        print(f"{r['method']:<8}{100 * r['fraction']:>9.1f}{r['kv_lora_rank']:>6}{r['rope_dim']:>6}{r['ppl_ratio']:>9.3f}{r['kl']:>10.4f}")


def plot(rows: list[dict], path: str, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in sorted({r["method"] for r in rows}):
        pts = sorted((r["fraction"], r["ppl_ratio"]) for r in rows if r["method"] == method)
        ax.plot([100 * p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    ax.axhline(1.5, color="grey", linestyle="--", linewidth=1, label="1.5x target")
    ax.set_xlabel("KV cache, % of source bytes/token")
    ax.set_ylabel("held-out perplexity, converted / source")
    ax.set_title(f"attnkit convert --to mla, one-shot ({model})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
