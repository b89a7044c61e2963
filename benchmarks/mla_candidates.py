"""One-shot quality of several MLA conversions side by side, without writing any of them.

    python benchmarks/mla_candidates.py reference --calib-tokens 8192 --eval-tokens 2048 \\
        --splits 28:48,30:46 --refit off,attention,uniform [--eval-seq-len 1024] [--out FILE.json]

Arguments other than --splits/--refit/--eval-seq-len/--out are `attnkit convert --to mla` arguments.
Every (kv_lora_rank:rope_dim, refit) pair is converted from the same calibration moments
(`attnkit.converters.mla.candidates.evaluate`: low-rank stage plus the optional query refit, fp32, no native
export) and scored on the same held-out rows (the validation split, --eval-tokens tokens, cut
into --eval-seq-len windows; default: the calibration length): perplexity x source, KL.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from attnkit.data import pack_tokens
from attnkit.converters.mla.candidates import Candidate, evaluate, prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", default="28:48", help="kv_lora_rank:rope_dim pairs, comma-separated")
    ap.add_argument("--refit", default="off,attention", help="refit modes: off, attention, uniform")
    ap.add_argument("--eval-seq-len", type=int, default=None, help="held-out window length (default: --calib-seq-len)")
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    args, convert_args = ap.parse_known_args()
    started = time.time()
    src, s, calib, held_out = prepare([*convert_args, "-o", "/nonexistent-attnkit-bench"])
    if args.eval_seq_len and args.eval_seq_len != held_out.shape[1]:
        from transformers import AutoTokenizer

        held_out = pack_tokens(AutoTokenizer.from_pretrained(src.path), s.calib, "validation", args.eval_seq_len,
                               s.eval_tokens, s.seed)
    layers = src.config["num_hidden_layers"]
    cands = [Candidate(f"r{r}:dr{dr}:{m}", int(dr), [int(r)] * layers, m)
             for r, dr in (x.split(":") for x in args.splits.split(",")) for m in args.refit.split(",")]
    src_ppl, res = evaluate(src, s, calib, held_out, cands)
    rows = [{"kv_lora_rank": c.ranks[0], "rope_dim": c.rope_dim, "refit": c.refit, "ppl": res[c.name]["ppl"],
             "ppl_ratio": res[c.name]["ppl"] / src_ppl, "kl": res[c.name]["kl"],
             "attn_rel_err_mean": res[c.name]["attn_rel_err_mean"]} for c in cands]
    print(f"source ppl {src_ppl:.3f} on {held_out.shape[0]} x {held_out.shape[1]} held-out tokens; "
          f"calibration {calib.shape[0]} x {calib.shape[1]}; {time.time() - started:.0f} s")
    print(f"{'r':>4}{'d_r':>5}  {'refit':<10}{'ppl':>9}{'ppl x':>8}{'KL':>9}{'attn err':>10}")
    for r in rows:
        print(f"{r['kv_lora_rank']:>4}{r['rope_dim']:>5}  {r['refit']:<10}{r['ppl']:>9.3f}{r['ppl_ratio']:>8.3f}"
              f"{r['kl']:>9.4f}{r['attn_rel_err_mean']:>10.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": convert_args, "eval_seq_len": held_out.shape[1],
                                              "source_ppl": src_ppl, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
