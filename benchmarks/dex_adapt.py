"""Measure DEX adaptation against plain continued training and LoRA only, same data and steps.

    python benchmarks/dex_adapt.py --model reference --tokens 49152 --out benchmarks/results/dex_adapt.json

Arms (each starts from MODEL and sees the same token rows in the same order):
  base        no training
  continued   every weight of the plain model trained (AdamW, --lr)
  lora        LoRA on q/k/v/o of the plain model (--lora-lr)
  dex         `attnkit convert --to dex` (calibrated head selection), then the same LoRA plus the DEX
              modules (`modules_to_save=["dex"]`); λ ramps in through `broadcast_step`
  diff        the same with `--to diff` (`modules_to_save=["diff", "diff_q_proj"]`)
  mla         `attnkit convert --to mla` (--mla-args), then LoRA on the MLA attention's projections
  mla+dex     `--to mla+dex` with the same split and heads, then that LoRA plus the DEX modules

Per arm: held-out perplexity (validation split), `attnkit eval` tasks through
`attnkit.evaluation.score.evaluate_model` when that module exists, normalised attention entropy of
the heads DEX selected (softmax maps), and the largest activation magnitudes (decoder-layer
outputs; attention outputs before o_proj). Writes JSON, prints a table, plots the loss curves.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

ARMS = ("base", "continued", "lora", "dex", "diff", "mla", "mla+dex")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# DeepSeek-V3 attention: the query (q_proj, or q_b_proj behind the exact q_a_proj), the latent's down and up
# projections, the output
MLA_LORA_TARGETS = ["q_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
SAVED_MODULES = {"dex": ["dex"], "diff": ["diff", "diff_q_proj"], "mla": None, "mla+dex": ["dex"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="reference")
    p.add_argument("--from-run", default=None, metavar="RUN_DIR",
                   help="instead of --model: the current checkpoint.pt of an `attnkit pretrain` run (e.g. runs/reference)")
    p.add_argument("--arms", default="base,continued,lora,dex")
    p.add_argument("--tokens", type=int, default=49152, help="adaptation tokens per arm")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4, help="full continued training")
    p.add_argument("--lora-lr", type=float, default=1e-3, help="LoRA and the DEX/DIFF modules")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--heads", default="auto")
    p.add_argument("--heads-fraction", type=float, default=0.5)
    p.add_argument("--mla-args", default="--kv-lora-rank 28 --rope-dim 48",
                   help="convert arguments of the mla arms (default: the README's 29.7 %% split of the reference)")
    p.add_argument("--data", default="python", help="text source (attnkit.data spec)")
    p.add_argument("--needles", default=None, metavar="LO,HI,DLO,DHI",
                   help="plant recall needles in the adaptation rows: one every LO-HI tokens, asked DLO-DHI tokens later "
                        "(a recipe's data.needles; recipes/reference-recall.yaml uses 60,120,140,400)")
    p.add_argument("--eval-rows", type=int, default=16, help="validation rows for ppl / entropy / activations")
    p.add_argument("--eval-limit", type=int, default=None, help="lm-eval documents per task (None = all)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/dex_adapt.json")
    p.add_argument("--render", default=None, metavar="JSON", help="only print the table and redraw the plot of a results file")
    return p.parse_args(argv)


# ---------------------------------------------------------------- models per arm


def load(path: Path):
    from transformers import AutoModelForCausalLM

    import attnkit.adapters  # noqa: F401  (attnkit_* model types)

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def with_lora(model, r: int, modules_to_save: list[str] | None, targets: list[str] = LORA_TARGETS):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=targets,
                        modules_to_save=modules_to_save, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def converted(method: str, source: Path, scratch: Path, args) -> Path:
    """`attnkit convert --to METHOD` of the source (fp32), once per run."""
    from attnkit.cli import main as cli

    out = scratch / method
    if (out / "config.json").is_file():  # converted once per run
        return out
    extra = ["--heads", args.heads, "--heads-fraction", str(args.heads_fraction)] if method.endswith("dex") else []
    if method.startswith("mla"):
        extra += args.mla_args.split()
    status = cli(["convert", "--to", method, str(source), "-o", str(out), "--dtype", "fp32", "--calib", args.data,
                  "--calib-tokens", "16384", "--calib-seq-len", str(args.seq_len), "--seed", str(args.seed), *extra])
    if status:
        raise SystemExit(f"attnkit convert --to {method} failed (exit status {status})")
    return out


def prepare(arm: str, source: Path, scratch: Path, args):
    """(model to train, parameters to train, learning rate) for one arm."""
    if arm in ("base", "continued"):
        model = load(source)
        return model, list(model.parameters()) if arm == "continued" else [], args.lr
    if arm == "lora":
        model = with_lora(load(source), args.lora_r, None)
    else:
        targets = MLA_LORA_TARGETS if arm.startswith("mla") else LORA_TARGETS
        model = with_lora(load(converted(arm, source, scratch, args)), args.lora_r, SAVED_MODULES[arm], targets)
    return model, [p for p in model.parameters() if p.requires_grad], args.lora_lr


def train(model, params, lr: float, rows: torch.Tensor, batch: int) -> list[list[float]]:
    """Plain AdamW over `rows` in order; the step is broadcast so DEX/DIFF λ ramps in."""
    from attnkit.training.schedules import broadcast_step

    if not params:
        return []
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    batches = list(rows.split(batch))
    curve = []
    model.train()
    for step, ids in enumerate(tqdm(batches, desc="train", leave=False)):
        broadcast_step(model, step, len(batches))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append([step, loss.item()])
    broadcast_step(model, len(batches), len(batches))
    model.eval()
    return curve


# ---------------------------------------------------------------- measurements


@torch.no_grad()
def held_out(model, rows: torch.Tensor, heads: list[list[int]]) -> dict:
    """Perplexity, entropy of the DEX-selected heads, largest activation magnitudes."""
    from attnkit.converters.calibration import calibrate

    nll, count, hidden_max, attn_max = 0.0, 0, 0.0, 0.0
    hooks = [m.register_forward_pre_hook(lambda _m, inp: _track(inp[0], store)) for n, m in model.named_modules()
             if n.endswith("self_attn.o_proj")]
    store = {"max": 0.0}
    for ids in rows.split(4):
        out = model(input_ids=ids, labels=ids, output_hidden_states=True)
        nll += float(out.loss) * ids[:, 1:].numel()
        count += ids[:, 1:].numel()
        hidden_max = max(hidden_max, max(float(h.abs().max()) for h in out.hidden_states[1:]))
    for h in hooks:
        h.remove()
    attn_max = store["max"]
    stats = calibrate(model, rows, torch.device("cpu"))
    selected = [float(stats["entropy"][layer, sel].mean()) for layer, sel in enumerate(heads)]
    return {
        "ppl": math.exp(nll / count),
        "entropy_selected_heads": sum(selected) / len(selected),
        "entropy_all_heads": float(stats["entropy"].mean()),
        "max_abs_hidden": hidden_max,
        "max_abs_attn_output": attn_max,
    }


def _track(x: torch.Tensor, store: dict) -> None:
    store["max"] = max(store["max"], float(x.abs().max()))


def lm_eval_metrics(model, tokenizer, limit) -> dict | None:
    try:
        from attnkit.evaluation.score import evaluate_model
    except ModuleNotFoundError:
        return None
    return evaluate_model(model, tokenizer=tokenizer, tasks="attnkit-core", limit=limit)["metrics"]


def unwrap(model):
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model


# ---------------------------------------------------------------- main


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.render:  # table + plot again from a results file
        results = json.loads(Path(args.render).read_text())
        write(results, Path(args.render))
        return results
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from attnkit.data import pack_tokens
    from attnkit.io.resolve import resolve_model

    scratch_root = tempfile.TemporaryDirectory()
    if args.from_run:
        source, origin = export_run_checkpoint(Path(args.from_run), Path(scratch_root.name) / "source")
    else:
        source, origin = resolve_model(args.model), {"model": args.model}
    tok = AutoTokenizer.from_pretrained(source)
    rows = adaptation_rows(tok, args)
    val = pack_tokens(tok, args.data, "validation", args.seq_len, args.eval_rows * args.seq_len, seed=args.seed)
    results: dict = {"settings": vars(args), "source": origin, "train_tokens": int(rows.numel()), "arms": {}}
    heads = None
    with tempfile.TemporaryDirectory() as scratch:
        for arm in [a for a in args.arms.split(",") if a]:
            if arm not in ARMS:
                raise SystemExit(f"unknown arm {arm!r} (expected {', '.join(ARMS)})")
            torch.manual_seed(args.seed)
            started = time.time()
            model, params, lr = prepare(arm, source, Path(scratch), args)
            if heads is None:
                heads = selected_heads(model, Path(scratch), args, source)
            curve = train(model, params, lr, rows, args.batch)
            model = unwrap(model).eval()
            entry = {"steps": len(curve), "trainable_params": sum(p.numel() for p in params), "loss_curve": curve,
                     "train_seconds": round(time.time() - started, 1), **held_out(model, val, heads)}
            entry["lm_eval"] = lm_eval_metrics(model, tok, args.eval_limit)
            results["arms"][arm] = entry
            partial = Path(args.out).with_suffix(".partial.json")  # survives an interrupted run
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({**results, "dex_selected_heads": heads}, indent=2))
            print(f"{arm}: ppl {entry['ppl']:.3f}  entropy(sel) {entry['entropy_selected_heads']:.4f}  "
                  f"max|h| {entry['max_abs_hidden']:.1f}  max|attn| {entry['max_abs_attn_output']:.2f}")
    results["dex_selected_heads"] = heads
    scratch_root.cleanup()
    write(results, Path(args.out))
    return results


def adaptation_rows(tokenizer, args) -> torch.Tensor:
    """The rows every arm trains on: a different seed from the DEX calibration rows, needles planted with --needles."""
    from attnkit.training.batches import load_train_rows
    from attnkit.training.recipe import DataSection, NeedleSection

    spec = [int(x) for x in args.needles.split(",")] if args.needles else []
    needles = NeedleSection(spacing=spec[:2], distance=spec[2:]) if spec else NeedleSection()
    data = DataSection(source=args.data, seq_len=args.seq_len, seed=args.seed + 1, needles=needles)
    return load_train_rows(tokenizer, data, args.tokens // args.seq_len)


def export_run_checkpoint(run_dir: Path, out: Path) -> tuple[Path, dict]:
    """An HF folder from a pretrain run's latest checkpoint (the reference model before it is exported)."""
    from dataclasses import fields

    from transformers import AutoTokenizer

    from attnkit.training.pretrain import ModelSpec, build_model

    recipe = json.loads((run_dir / "recipe.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "tokenizer")
    names = {f.name for f in fields(ModelSpec)}
    model = build_model(ModelSpec(**{k: v for k, v in recipe["model"].items() if k in names}), tokenizer)
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=False, map_location="cpu")
    model.load_state_dict(ckpt["model"])
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    step = int(ckpt["step"])
    tokens = step * recipe["train"]["batch_size"] * recipe["train"]["seq_len"]
    val = [e["val_loss"] for e in ckpt["log"] if "val_loss" in e]
    return out, {"run": str(run_dir), "step": step, "tokens_seen": tokens, "planned_tokens": recipe["train"]["tokens"],
                 "last_val_loss": val[-1] if val else None}


def selected_heads(model, scratch: Path, args, source: Path) -> list[list[int]]:
    """The heads `--to dex` selects (one calibration run), so every arm is measured on the same heads."""
    path = converted("dex", source, scratch, args)
    return json.loads((path / "attnkit_report.json").read_text())["heads"]["selected"]


def write(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(table(results))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for arm, entry in results["arms"].items():
        if entry["loss_curve"]:
            steps, losses = zip(*entry["loss_curve"])
            ax.plot(steps, losses, label=arm)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def table(results: dict) -> str:
    cols = ["arm", "ppl (val rows)", "ppl (attnkit-ppl)", "complete", "recall-256", "recall-512", "recall-1024", "H(sel)", "max|h|", "max|attn|", "params"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for arm, e in results["arms"].items():
        m = e.get("lm_eval") or {}
        acc = lambda task: f"{m[task]['acc']:.3f}" if task in m else "–"  # noqa: E731
        lines.append("| " + " | ".join([
            arm, f"{e['ppl']:.3f}", f"{m['attnkit-ppl']['token_perplexity']:.3f}" if "attnkit-ppl" in m else "–", acc("attnkit-complete"), acc("attnkit-recall-256"), acc("attnkit-recall-512"),
            acc("attnkit-recall-1024"), f"{e['entropy_selected_heads']:.4f}", f"{e['max_abs_hidden']:.1f}",
            f"{e['max_abs_attn_output']:.2f}", str(e["trainable_params"]),
        ]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
