"""Do DEX and DIFF earn their place? The four measures of `attnkit.evaluation.robustness` on adapted
models, each arm against a baseline arm, as paired differences with 95 % intervals.

    # train the arms (benchmarks/dex_adapt.py builds them: same rows, same steps, same LoRA), then measure
    python benchmarks/dex_gains.py --train-from out/reference-recall --arms lora,dex,diff --seeds 0 \\
        --tokens 24576 --seq-len 1024 --batch 1 --needles 60,120,140,400 --work out/dex-gains \\
        --baseline lora --out benchmarks/results/dex_gains.json
    # MLA + DEX against MLA (dex_adapt's mla arms: --mla-args there, the README's split by default)
    python benchmarks/dex_gains.py --train-from attnkit/assets/reference --arms mla,mla+dex --seeds 0,1,2 \
        --baseline mla --out benchmarks/results/dex_gains_mla.json
    # or measure model folders you already have (one --arm per arm, seeds as a comma list)
    python benchmarks/dex_gains.py --arm lora=A0,A1 --arm dex=B0,B1 --baseline lora --out RESULT.json

Per model folder, the measures are cached in FOLDER/robustness.json. Measures (robustness.py):
the attnkit-distract-{near,mid,far} tasks per item; per validation row the NLL in full precision, with
RTN int8 / int4 weights (group 64) and with int8 keys/values; per row the kurtosis and top-1 %
magnitude of attention outputs and hidden states (mean over layers); per distract-far item the
attention mass on the needle's value and on the decoys'. Writes RESULT.json, RESULT.md (table) and
RESULT.png (the differences with their intervals).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dex_adapt

from attnkit.evaluation import robustness as rb
from attnkit.evaluation.tasks import DISTRACT

MASS_TASK = "attnkit-distract-far"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", action="append", default=[], metavar="NAME=DIR[,DIR...]", help="an arm's model folders, one per seed")
    p.add_argument("--train-from", default=None, metavar="MODEL", help="build --arms from MODEL with dex_adapt (missing folders only)")
    p.add_argument("--arms", default="lora,dex,diff")
    p.add_argument("--seeds", default="0")
    p.add_argument("--work", default="out/dex-gains", help="where trained arms go (WORK/ARM-sSEED)")
    p.add_argument("--tokens", type=int, default=24576)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--needles", default=None, help="as dex_adapt --needles")
    p.add_argument("--baseline", default="lora")
    p.add_argument("--val-rows", type=int, default=16, help="validation rows for the NLL and outlier measures")
    p.add_argument("--val-seq-len", type=int, default=512)
    p.add_argument("--limit", type=int, default=None, help="items per distract task (None: all 200)")
    p.add_argument("--mass-items", type=int, default=100)
    p.add_argument("--out", default="benchmarks/results/dex_gains.json")
    p.add_argument("--render", action="store_true", help="only redo the table and plot from --out")
    return p.parse_args(argv)


# ---------------------------------------------------------------- arms


def train_arm(arm: str, seed: int, args, source: Path, folder: Path) -> None:
    """One arm as dex_adapt builds it (converted in a scratch folder, LoRA merged), saved to `folder`."""
    import tempfile

    from transformers import AutoTokenizer

    adapt = dex_adapt.parse_args(["--seq-len", str(args.seq_len), "--tokens", str(args.tokens), "--batch",
                                  str(args.batch), "--seed", str(seed), *(["--needles", args.needles] if args.needles else [])])
    tok = AutoTokenizer.from_pretrained(source)
    rows = dex_adapt.adaptation_rows(tok, adapt)
    started = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        torch.manual_seed(seed)
        model, params, lr = dex_adapt.prepare(arm, source, Path(scratch), adapt)
        curve = dex_adapt.train(model, params, lr, rows, args.batch)
        model = dex_adapt.unwrap(model).eval()
        tmp = folder.with_name(folder.name + ".tmp")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for code in (Path(scratch) / arm).glob("*.py"):  # the modeling code of a converted arm (auto_map)
            shutil.copy(code, tmp / code.name)
    (tmp / "dex_gains_train.json").write_text(json.dumps({
        "arm": arm, "seed": seed, "source": str(source), "train_tokens": int(rows.numel()), "steps": len(curve),
        "trainable_params": sum(p.numel() for p in params), "loss_curve": curve, "seconds": round(time.time() - started, 1)}))
    tmp.rename(folder)


def measured(folder: Path, args) -> dict:
    """The folder's robustness.json, measured now if missing."""
    cache = folder / "robustness.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    from attnkit.data import pack_tokens
    from attnkit.evaluation.load import load_model

    model, tok, _ = load_model(str(folder), "fp32", "cpu")
    rows = pack_tokens(tok, "python", "validation", args.val_seq_len, args.val_rows * args.val_seq_len, seed=0)
    started = time.time()
    result = rb.measure(model, tok, rows, DISTRACT, args.limit, MASS_TASK, args.mass_items)
    result["seconds"] = round(time.time() - started, 1)
    cache.write_text(json.dumps(result))
    return result


# ---------------------------------------------------------------- per-item values of each measure


def per_item(m: dict) -> dict[str, list[float]]:
    """measure name → one value per item/row (what `paired` compares)."""
    nll = m["nll"]
    out = {f"{t.removeprefix('attnkit-')} acc": [float(x) for x in m["distract"][t]] for t in m["distract"]}
    out["NLL fp32 (nats/token)"] = nll["fp"]
    for key, label in (("w8", "int8 weights"), ("w4", "int4 weights"), ("kv8", "int8 KV")):
        if nll[key]:
            out[f"NLL rise, {label}"] = [q - f for q, f in zip(nll[key], nll["fp"])]
    for kind in ("attention", "hidden"):
        for stat, label in (("kurtosis", "kurtosis"), ("top1pct", "top-1 % magnitude")):
            layers = m["outliers"][kind][stat]
            out[f"{kind} {label} (layer mean)"] = [sum(v) / len(v) for v in zip(*layers)]
    if m["mass"]["needle"]:
        out["attention mass on needle"] = m["mass"]["needle"]
        out["attention mass on decoys"] = m["mass"]["decoys"]
    return out


def compare(arms: dict[str, list[dict]], baseline: str) -> dict:
    """For each arm ≠ baseline and each measure: both means, B − A with its interval, McNemar p for accuracies."""
    values = {arm: [per_item(m) for m in ms] for arm, ms in arms.items()}
    base = values[baseline]
    out = {}
    for arm, seeds in values.items():
        if arm == baseline:
            continue
        n = min(len(seeds), len(base))  # seed i of the arm against seed i of the baseline
        rows = {}
        for measure in base[0]:
            if measure not in seeds[0]:
                continue
            a, b = [s[measure] for s in base[:n]], [s[measure] for s in seeds[:n]]
            row = {"baseline": _mean(a), "arm": _mean(b), **rb.paired(a, b)}
            if measure.endswith(" acc"):
                row["mcnemar_p"] = rb.mcnemar_p([int(x) for s in a for x in s], [int(x) for s in b for x in s])
            rows[measure] = row
        out[arm] = rows
    return out


def _mean(seeds: list[list[float]]) -> float:
    return sum(map(sum, seeds)) / sum(map(len, seeds))


# ---------------------------------------------------------------- output


def table(result: dict) -> str:
    """One row per measure: the baseline's mean, then per arm its difference [95 %] and, under it, the
    smallest difference the test would detect with 80 % power (and McNemar's p for accuracies)."""
    base, comps = result["baseline"], result["comparisons"]
    arms = list(comps)
    lines = ["| measure | " + base + " | " + " | ".join(f"{a} − {base} [95 %]" for a in arms) + " |",
             "|---|---|" + "---|" * len(arms)]
    for measure in comps[arms[0]]:
        cells = []
        for arm in arms:
            r = comps[arm][measure]
            p = f", p {r['mcnemar_p']:.2g}" if "mcnemar_p" in r else ""
            cells.append(f"{r['difference']:+.4f} [{r['ci95'][0]:+.4f}, {r['ci95'][1]:+.4f}] (mde {r['mde80']:.4f}{p})")
        lines.append(f"| {measure} | {comps[arms[0]][measure]['baseline']:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    comps = result["comparisons"]
    measures = list(next(iter(comps.values())))
    cols = 4
    fig, axes = plt.subplots((len(measures) + cols - 1) // cols, cols, figsize=(3.2 * cols, 1.6 * ((len(measures) + cols - 1) // cols)),
                             squeeze=False)
    for ax, measure in zip(axes.flat, measures):
        for y, (arm, rows) in enumerate(comps.items()):
            r = rows[measure]
            lo, hi = r["ci95"]
            ax.errorbar([r["difference"]], [y], xerr=[[r["difference"] - lo], [hi - r["difference"]]], fmt="o", capsize=3)
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_yticks(range(len(comps)), list(comps))
        ax.set_title(measure, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(4))
    for ax in list(axes.flat)[len(measures):]:
        ax.axis("off")
    fig.suptitle(f"arm − {result['baseline']}: paired differences, 95 % intervals", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(result: dict, out: Path) -> None:
    result["comparisons"] = compare({a: [json.loads((Path(f) / "robustness.json").read_text()) for f in fs]
                                     for a, fs in result["arms"].items()}, result["baseline"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(table(result) + "\n")
    plot(result, out.with_suffix(".png"))
    print(table(result))


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    if args.render:
        result = json.loads(out.read_text())
        write(result, out)
        return result
    arms = {a.split("=", 1)[0]: a.split("=", 1)[1].split(",") for a in args.arm}
    if args.train_from:
        source = Path(args.train_from)
        for arm in [a for a in args.arms.split(",") if a]:
            arms[arm] = []
            for seed in (int(s) for s in args.seeds.split(",")):
                folder = Path(args.work) / f"{arm}-s{seed}"
                if not (folder / "config.json").is_file():
                    train_arm(arm, seed, args, source, folder)
                arms[arm].append(str(folder))
    if args.baseline not in arms:
        raise SystemExit(f"--baseline {args.baseline!r} is not an arm ({', '.join(arms)})")
    for arm, folders in arms.items():
        for f in folders:
            print(f"{arm}: {f} measured in {measured(Path(f), args).get('seconds')} s", flush=True)
    result = {"settings": vars(args), "baseline": args.baseline, "arms": arms,
              "train": {a: [_train_info(Path(f)) for f in fs] for a, fs in arms.items()}}
    write(result, out)
    return result


def _train_info(folder: Path) -> dict | None:
    path = folder / "dex_gains_train.json"
    if not path.is_file():
        return None
    info = json.loads(path.read_text())
    return {k: v for k, v in info.items() if k != "loss_curve"} | {"final_loss": info["loss_curve"][-1][1] if info["loss_curve"] else None}


if __name__ == "__main__":
    main()
