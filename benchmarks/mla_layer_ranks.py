"""Would per-layer latent ranks beat one uniform kv_lora_rank at the same total cache? (issue 3, item 6)

    python benchmarks/mla_layer_ranks.py reference --kv-lora-rank 28 --rope-dim 48 \\
        --calib-tokens 8192 --eval-tokens 2048 [--refit both|on|off] [--out docs/mla_layer_ranks.json]

Arguments after MODEL are `attnkit convert --to mla` arguments (no -o needed). Per layer, the
latent's PCA eigenvalues under the conversion's own objective say what each kept channel buys;
ranks are then allocated greedily under the same total (sum over layers = layers x kv_lora_rank),
with each layer's gains either as a fraction of its own total ("relative") or as they are
("absolute"). Every allocation is converted side by side (`attnkit.converters.mla.candidates.evaluate`,
low-rank stage, no output written) and scored on the held-out rows: one-shot perplexity and KL.
DeepSeek-V3 itself cannot express per-layer ranks (one kv_lora_rank for all layers).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from attnkit.converters.mla.budget import allocate_ranks, max_rank
from attnkit.converters.mla.candidates import Candidate, evaluate, prepare, rope_score_pass, spectra_pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refit", choices=["on", "off", "both"], default="both", help="query refit in the candidates")
    ap.add_argument("--out", default="docs/mla_layer_ranks.json")
    args, convert_args = ap.parse_known_args()
    started = time.time()
    src, s, calib, held_out = prepare([*convert_args, "-o", "/nonexistent-attnkit-bench"])
    layers = src.config["num_hidden_layers"]
    scores = rope_score_pass(src, s, calib)
    spectra = spectra_pass(src, s, calib, s.rope_dim, scores)
    top = max_rank(src.shape, s.rope_dim)
    allocations = {
        "uniform": [s.kv_lora_rank] * layers,
        "relative": allocate_ranks(spectra, s.kv_lora_rank * layers, 2, top, relative=True),
        "absolute": allocate_ranks(spectra, s.kv_lora_rank * layers, 2, top, relative=False),
    }
    modes = {"on": ["attention"], "off": ["off"], "both": ["off", "attention"]}[args.refit]
    cands = [Candidate(f"{name}/refit={m}", s.rope_dim, ranks, m) for name, ranks in allocations.items() for m in modes]
    src_ppl, res = evaluate(src, s, calib, held_out, cands, scores, desc="allocations")
    rows = [{"allocation": c.name.split("/")[0], "refit": c.refit, "ranks": c.ranks,
             "cached_values_padded": max(c.ranks) + s.rope_dim, "ppl": res[c.name]["ppl"],
             "ppl_ratio": res[c.name]["ppl"] / src_ppl, "kl": res[c.name]["kl"],
             "attn_rel_err_mean": res[c.name]["attn_rel_err_mean"]} for c in cands]
    out = {"argv": convert_args, "source_ppl": src_ppl, "rope_dim": s.rope_dim, "kv_lora_rank": s.kv_lora_rank,
           "spectra_head": [[float(v) for v in sp[:8]] for sp in spectra], "rows": rows,
           "wall_time_s": round(time.time() - started, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"source ppl {src_ppl:.3f}; total latent channels {s.kv_lora_rank * layers} (+ rope_dim {s.rope_dim} per layer)")
    print(f"{'allocation':<10}{'refit':<11}{'ranks per layer':<24}{'ppl x':>8}{'KL':>9}{'attn err':>10}")
    for r in rows:
        print(f"{r['allocation']:<10}{r['refit']:<11}{str(r['ranks']):<24}{r['ppl_ratio']:>8.3f}{r['kl']:>9.4f}"
              f"{r['attn_rel_err_mean']:>10.4f}")


if __name__ == "__main__":
    main()
