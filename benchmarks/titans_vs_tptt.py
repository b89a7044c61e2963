"""TPTT on the bundled reference with the window, tokens and rows of attnkit's Titans heals.

TPTT (Furfaro 2025, `pip install tptt`) mixes each layer's softmax attention with a linear-attention
memory (DeltaNet / DeltaProduct over the layer's own q/k/v) through a Memory-as-Gate weight, and is
fine-tuned with LoRA. Its `max_self_attn_length` cuts the *input* of the softmax branch to its last
tokens (a decode window, modeling_tptt.py:803-820), so a training row longer than the window fails;
its code says a sliding-window base needs no cut ("Not needed for SWA", line 803). So the softmax
branch gets its window from the base model instead: the reference's Llama weights in transformers'
Mistral class (the same layers plus `sliding_window`), which is the reference exactly on rows of at
most W tokens (checked below) and a per-token window of W on longer ones — the same window
`attnkit convert --to titans --window W` keeps. Both branches then hold bounded state.

TPTT's own recipe (its docs/liza-training.md): LoRA r 8, alpha 16, dropout 0.05 on q/k/v/o; AdamW
lr 5e-4 with HF Trainer's defaults (linear decay, no warmup, clip 1.0, no weight decay); the LM loss
alone; the MaG weight ramped linearly from 0.01 to 0.5 (`LiZACallback`, over 100 steps there; here
over `--ramp-steps`, as attnkit's gate ramp, because the whole run is 32 steps). The rows are
attnkit finetune's (`data.source python`, 1024-token rows, seed 0), so both sides see the same
tokens in the same order, and the validation rows are the same 16 × 1024 tokens.

Run with tptt importable next to attnkit (same torch / transformers), e.g.
    python3 -m venv /work/venv-tptt && /work/venv-tptt/bin/pip install torch==2.13.0 tptt
    mkdir -p /work/tptt-path && ln -s /work/venv-tptt/lib/python3.11/site-packages/{tptt,einops} /work/tptt-path/
    PYTHONPATH=/work/tptt-path python benchmarks/titans_vs_tptt.py --window 128 --out out/t16/tptt-w128
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from attnkit.data import pack_tokens
from attnkit.evaluation.score import evaluate_model
from attnkit.io.resolve import resolve_model
from attnkit.training.batches import EpochRows


def sliding_twin(llama: LlamaForCausalLM, window: int) -> MistralForCausalLM:
    """The Llama's weights in Mistral's class with a per-token window of `window` keys (eager attention:
    TPTT casts the mask to the hidden dtype, which an SDPA boolean mask would not survive)."""
    fields = llama.config.to_dict()
    for key in ("model_type", "architectures", "auto_map", "transformers_version"):
        fields.pop(key, None)
    config = MistralConfig(**fields, sliding_window=window)
    config._attn_implementation = "eager"
    twin = MistralForCausalLM(config)
    missing, unexpected = twin.load_state_dict(llama.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise SystemExit(f"weights do not map onto Mistral: missing {missing}, unexpected {unexpected}")
    twin.tie_weights()
    return twin.eval()


def check_twin(llama: LlamaForCausalLM, twin: MistralForCausalLM, rows: torch.Tensor, window: int) -> float:
    """Relative logits difference on the first `window` tokens (where the window cuts nothing)."""
    ids = rows[:1, :window]
    with torch.no_grad():
        a, b = llama(ids).logits, twin(ids).logits
    return float((a - b).norm() / a.norm())


def mag_weights(model: torch.nn.Module, weight: float) -> None:
    """What tptt.LiZACallback does at each step: one MaG weight for every layer."""
    for module in model.modules():
        if hasattr(module, "memory_gate"):
            module.memory_gate.mag_weight = torch.tensor(weight)


def validation_ppl(model: torch.nn.Module, rows: torch.Tensor) -> float:
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for row in rows:
            out = model(row[None], labels=row[None], use_cache=False)
            total += float(out.loss) * (len(row) - 1)
            count += len(row) - 1
    return math.exp(total / count)


def train(model: torch.nn.Module, dataset: EpochRows, args: argparse.Namespace) -> list[float]:
    """TPTT's recipe on attnkit's rows: LM loss, AdamW, linear decay, MaG ramp after each step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = len(dataset)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / steps))
    losses = []
    model.train()
    mag_weights(model, args.mag_start)
    for step in tqdm(range(steps), desc="TPTT heal", unit="step"):
        ids = dataset[step]["input_ids"][None]
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(float(loss))
        done = step + 1
        mag_weights(model, args.mag_start + (args.mag - args.mag_start) * min(1.0, done / args.ramp_steps))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32768, help="training tokens (1024-token rows)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--mag", type=float, default=0.5, help="final MaG weight")
    ap.add_argument("--mag-start", type=float, default=0.01)
    ap.add_argument("--ramp-steps", type=int, default=8)
    ap.add_argument("--tasks", default="attnkit-ppl,attnkit-recall-far")
    ap.add_argument("--limit", type=int, default=None, help="items per task (a smoke run; not a result)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import tptt  # noqa: F401  (imported late: the error names the missing package, not a line of this file)
    from peft import LoraConfig, get_peft_model
    from tptt import get_tptt_model

    import attnkit.evaluation.scoring as scoring
    from lm_eval.models.huggingface import HFLM

    torch.manual_seed(0)
    folder = resolve_model("reference")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    llama = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    seq_len = 1024
    rows = pack_tokens(tokenizer, "python", "train", seq_len, args.tokens, 0)
    dataset = EpochRows(rows, args.tokens // seq_len, 0)
    val_rows = pack_tokens(tokenizer, "python", "validation", seq_len, 16384, 0)

    twin = sliding_twin(llama, args.window)
    twin_error = check_twin(llama, twin, rows, args.window)
    report = {"window": args.window, "tokens": args.tokens, "rows": len(dataset), "lr": args.lr,
              "lora_r": args.lora_r, "mag": args.mag, "ramp_steps": args.ramp_steps,
              "sliding_twin_rel_error_within_window": twin_error,
              "validation_ppl_reference": validation_ppl(llama, val_rows),
              "validation_ppl_window_alone": validation_ppl(twin, val_rows)}
    del llama

    model, _ = get_tptt_model(twin, twin.config, max_self_attn_length=None, mag_weight=args.mag_start)
    model.config.use_cache = False  # the linear state would otherwise persist in TPTT's LCache between calls
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.05, bias="none",
                      task_type="CAUSAL_LM", target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(model, lora)
    report["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    report["validation_ppl_before"] = validation_ppl(model, val_rows)
    started = time.process_time()
    report["train_losses"] = train(model, dataset, args)
    report["train_cpu_s"] = round(time.process_time() - started, 1)
    model = model.merge_and_unload().eval()
    report["validation_ppl_after"] = validation_ppl(model, val_rows)

    # lm-eval's own scoring path: attnkit's shared-prefix path repeats a transformers cache across
    # continuations, and TPTT keeps its linear state outside that cache
    scoring.SharedPrefixLM._loglikelihood_tokens = HFLM._loglikelihood_tokens
    result = evaluate_model(model, tokenizer, tasks=[t for t in args.tasks.split(",") if t],
                            limit=args.limit, name=f"tptt-w{args.window}")
    report["eval"] = {k: result[k] for k in ("metrics", "n", "params", "seconds")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tptt_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "train_losses"}, indent=2))


if __name__ == "__main__":
    main()
