"""`attnkit_report.json` of `convert --to gqa` (the MLA report's layout: steps with attention error,
logits error, KL and perplexity on held-out rows; KV bytes before/after) and its printout."""

from __future__ import annotations

from attnkit import __version__
from attnkit.converters.common import source_info
from attnkit.converters.mla.report import format_steps, kv_bytes
from attnkit.evaluation.kv import short_dtype
from attnkit.evaluation.ppl import held_out

STEP_INFO = {
    "align": "per KV head: a rotation (and scale) per RoPE frequency pair folded into the queries, an orthogonal "
    "map of the values folded into o_proj, fitted by generalised Procrustes within each group (exact)",
    "merge": "one KV head per group: keys averaged per RoPE pair weighted by the query energy, values by the "
    "o_proj metric; each query head's pairs refit by a complex factor to its source scores; query heads "
    "reordered so each group's are contiguous",
    "refit": "o_proj refit by least squares on the calibration rows to the source attention's output (every "
    "head compensates the others' merge error); written in the output dtype",
}
MEAN_INFO = "one KV head per group of contiguous heads: plain mean of the K and V projections (Ainslie et al. 2023)"


def build_report(src, s, metrics: dict, attn_err: dict, src_ppl: float, per_layer: list) -> dict:
    shape, layers = src.shape, src.config["num_hidden_layers"]
    itemsize = s.out_dtype.itemsize
    steps = []
    for name, m in metrics.items():
        what = MEAN_INFO if s.merge == "mean" else STEP_INFO[name]
        steps.append({"name": name, "exact": name == "align", "what": what,
                      "attn_rel_err_mean": attn_err[name].mean, "attn_rel_err_max": attn_err[name].max, **m})
    after = list(metrics.values())[-1]["ppl"] if metrics else src_ppl
    window = src.config.get("sliding_window")
    return {
        "attnkit_version": __version__,
        "method": "gqa",
        "source": source_info(src.path, src.config.get("model_type")),
        "settings": s.public(),
        "target": {"model_type": src.config.get("model_type"), "num_key_value_heads": s.kv_heads,
                   "num_key_value_heads_before": shape.G, "num_attention_heads": shape.H, "merge": s.merge,
                   "sliding_window": window if window and src.config.get("use_sliding_window", True) else None},
        "kv_cache_bytes_per_token": {"before": kv_bytes(layers, 2 * shape.G * shape.d, itemsize),
                                     "after": kv_bytes(layers, 2 * s.kv_heads * shape.d, itemsize),
                                     "dtype": short_dtype(s.out_dtype)},
        "kv_cache_fraction": s.kv_heads / shape.G,
        "steps": steps,
        "lossy_steps": [k for k in metrics if k != "align"],
        "ppl": {"before": src_ppl, "after": after},
        "load": {"trust_remote_code": False, "needs": f"transformers ({src.config.get('model_type')}, unchanged architecture)"},
        "calibration": {"source": s.calib, "tokens": s.calib_tokens, "seq_len": s.seq_len},
        "layers": per_layer,
    }


def format_report(report: dict) -> str:
    lines = format_steps(report)
    t = report["target"]
    lines.append(f"KV heads: {t['num_key_value_heads_before']} -> {t['num_key_value_heads']} (merge: {t['merge']})")
    lines.append(f"{held_out(report.get('calibration'))}: {report['ppl']['before']:.4f} -> {report['ppl']['after']:.4f}")
    return "\n".join(lines)
