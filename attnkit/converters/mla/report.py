"""`attnkit_report.json` for MLA conversions (schema: the cross-team contract) and its table."""

from __future__ import annotations

import textwrap

from attnkit import __version__
from attnkit.converters.common import source_info
from attnkit.converters.params import format_params
from attnkit.converters.mla.engines import engine_support
from attnkit.evaluation.kv import kv_change, short_dtype
from attnkit.evaluation.ppl import HELD_OUT, held_out
from attnkit.evaluation.steps import ALONE, step_alone

STEP_INFO = {
    "exact": "GQA as MLA: latent = raw K and V of all heads, RoPE on every key component",
    "rope": "RoPE reduced to the shared d_r-dim key; the other key components lose RoPE",
    "balance": "K-NoPE scaled against V before the factorisation (exact by itself)",
    "low-rank": "joint activation-aware PCA of [K-NoPE; V] to kv_lora_rank - 1 channels",
    "refit": "NoPE query refit by least squares to the source's RoPE'd scores (mean rotation over the "
    "distances each head attends to)",
    "native": "DeepSeek-V3 layer as transformers runs it: latent RMSNorm with a constant channel, "
    "output dtype rounding",
}
# QK-norm sources: the `exact` step on the folded norms (deepseek_v3) or the lifted input (attnkit)
FOLDED_EXACT = ("QK norms folded into q_proj/k_proj as their weights times one least-squares constant per query "
                "head (lossy: the norm step alone), then GQA as MLA")
LIFTED_EXACT = "GQA as MLA on the normalised keys and the values: the latent is written after the source's key norm"
ATTNKIT_NATIVE = "the attnkit format as it runs (latent from the normalised keys, no latent norm), output dtype rounding"
FIT = "each layer's every weight, relative squared error on the calibration rows, per layer in `layers[].fit`"
ENGINE_NATIVE = ("DeepSeek-V3 layer in the engine form (no biases, interleaved RoPE, q latent of rank D): latent "
                 "RMSNorm linear through its epsilon, residual stream scaled, output dtype rounding")


def kv_bytes(layers: int, values: int, itemsize: int) -> int:
    return layers * values * itemsize


def build_report(src, s, tgt_cfg, metrics: dict, attn_err: dict, src_ppl: float, per_layer: list) -> dict:
    shape, layers = src.shape, src.config["num_hidden_layers"]
    itemsize = s.out_dtype.itemsize
    full_rope = s.rope_dim == shape.G * shape.d and s.rope_frequencies == "exact"
    data_rank = 2 * shape.G * shape.d - s.rope_dim
    qk = src.family.qk_norm is not None
    folded = qk and s.format == "deepseek_v3"
    exact = {"exact": not folded, "rope": full_rope, "balance": True, "low-rank": s.data_rank >= data_rank,
             "refit": full_rope, "native": False}
    steps = []
    what_of = {**STEP_INFO, **({"exact": FOLDED_EXACT} if folded else {}), **({"native": ENGINE_NATIVE} if s.target == "engines" else {}),
               **({"exact": LIFTED_EXACT, "native": ATTNKIT_NATIVE} if s.format == "attnkit" else {})}
    if s.fit_steps:
        what_of["native"] += f"; then fitted by gradient to the source attention's output ({FIT}, {s.fit_steps} steps)"
    for name, m in metrics.items():
        what = what_of[name]
        steps.append({"name": name, "exact": exact[name], "alone": _alone(name, exact[name], s, folded), "what": what,
                      "attn_rel_err_mean": attn_err[name].mean, "attn_rel_err_max": attn_err[name].max, **m})
    lossy = [n for n in ("exact", "rope", "low-rank") if not exact[n]]
    return {
        "attnkit_version": __version__,
        "method": "mla",
        "source": source_info(src.path, src.config.get("model_type")),
        "settings": s.public(),
        "target": {"model_type": tgt_cfg.model_type, "kv_lora_rank": s.kv_lora_rank, "qk_rope_head_dim": s.rope_dim,
                   "q_lora_rank": getattr(tgt_cfg, "q_lora_rank", None), "rope_parameters": tgt_cfg.rope_parameters,
                   "v_head_dim": s.v_head_dim, "constant_channel": s.target != "engines" and s.format != "attnkit",
                   "form": "attnkit" if s.format == "attnkit" else s.target, "format": s.format},
        "kv_cache_bytes_per_token": {"before": kv_bytes(layers, 2 * shape.G * shape.d, itemsize),
                                     "after": kv_bytes(layers, s.kv_lora_rank + s.rope_dim, itemsize),
                                     "dtype": short_dtype(s.out_dtype)},  # the output's dtype, as eval/bench count it
        "kv_cache_fraction": (s.kv_lora_rank + s.rope_dim) / (2 * shape.G * shape.d),
        "steps": steps,
        "lossy_steps": lossy,
        "ppl": {"before": src_ppl, "after": metrics["native"]["ppl"]},
        "load": {"trust_remote_code": s.format == "attnkit", "rope_frequencies": s.rope_frequencies, "needs": _needs(s)},
        "serving": ATTNKIT_SERVING if s.format == "attnkit" else
        engine_support(s.kv_lora_rank, s.rope_dim, shape.d, s.v_head_dim, s.target, s.rope_frequencies),
        **({"qk_norm_fold": {k: metrics["exact"][k] for k in ("kl", "ppl", "logits_rel_err_mean")}} if folded else {}),
        **({"sliding_window": windows} if (windows := sliding_windows(src)) else {}),
        "calibration": {"source": s.calib, "tokens": s.calib_tokens, "seq_len": s.seq_len},
        "layers": per_layer,
    }


# What a step does by itself, in the word the printout and the card show (`exact` only where the step
# leaves every logit unchanged; the error columns beside it measure the model up to that step).


def _alone(name: str, exact: bool, s, folded: bool) -> str:
    if name == "native" and s.fit_steps:
        return "fitted"
    if name == "native":
        return "engine form" if s.target == "engines" and s.format != "attnkit" else "rounding"
    if name == "exact" and folded:
        return "lossy fold"
    return "exact" if exact else "lossy"


def sliding_windows(src) -> dict | None:
    """The sliding-window layers kept as windows (a family with layer types, Gemma-3): the window and
    the layers; their latent cache holds the last window - 1 tokens, as the source's KV cache does."""
    if not src.family.by_layer_type:
        return None
    layers = [i for i, kind in enumerate(src.hf_config.layer_types) if kind == "sliding_attention"]
    return {"window": int(src.hf_config.sliding_window), "layers": layers} if layers else None


ATTNKIT_SERVING = {"transformers": "yes, with trust_remote_code=True (or after `import attnkit`)",
                   "llama.cpp, vLLM, SGLang": "no: custom attention (--format deepseek_v3 writes a plain checkpoint)"}


def _needs(s) -> str:
    if s.format == "attnkit":
        return "transformers >= 5 with trust_remote_code=True (the attnkit MLA code ships in the folder)"
    if s.target == "engines":
        return "any DeepSeek-V3 engine: transformers, llama.cpp, vLLM, SGLang (no biases, plain RoPE ladder; sizes: `serving`)"
    if s.rope_frequencies == "exact":
        return "transformers >= 5 only (attention biases, longrope frequency factors)"
    return "transformers >= 5 only (attention biases)"


def params_why(report: dict, shape) -> dict[str, tuple[str, str]]:
    """Why each part of the MLA output has the parameters it has (converters.params): the KV cache
    shrinks while the weights grow, and the report says by how much and why."""
    t = report["target"]
    d, d_r, r, v = shape.d, t["qk_rope_head_dim"], t["kv_lora_rank"], t.get("v_head_dim") or shape.d
    queries = f"each head's query gains the {d_r} decoupled RoPE dims ({d} -> {d + d_r})"
    short_q = f"query {d} -> {d + d_r} dims per head"
    if t.get("q_lora_rank"):
        queries += f", through a query latent of rank {t['q_lora_rank']} (q_a_proj + q_b_proj)"
        short_q += f", q latent of rank {t['q_lora_rank']}"
    return {
        "LM head": ("untied for the engines", "written untied, as DeepSeek-V3 engines read it (vLLM does not tie "
                    "it); the source ties it to its embeddings"),
        "queries": (short_q, queries),
        "keys and values": (f"kv_a_proj + kv_b_proj to {shape.H} heads",
                            f"k_proj + v_proj ({shape.G} KV heads) become kv_a_proj (to the {r} + {d_r} cached values) "
                            f"and kv_b_proj (latent to all {shape.H} heads' keys and values, {d} + {v} each)"),
        "attention output": ("o_proj bias", "o_proj gains a bias (the transformers form's constant latent channel)"),
    }


def format_steps(report: dict) -> list[str]:
    """The per-step table and the KV line (shared by every streaming converter's printout)."""
    cols = ["attn_rel_err_mean", "attn_rel_err_max", "logits_rel_err_mean", "logits_rel_err_max", "kl", "ppl"]
    names = {"ppl": HELD_OUT}
    head = f"{'step':<10}{'step alone':<13}" + "".join(f"{names.get(c, c.replace('_rel_err', '')):>14}" for c in cols)
    lines = [head, "-" * len(head)]
    for st in report["steps"]:
        lines.append(f"{st['name']:<10}{step_alone(st):<13}" + "".join(f"{st[c]:>14.3e}" for c in cols))
    kinds = dict.fromkeys(step_alone(st) for st in report["steps"])
    lines.append("step alone: what the step does by itself; the error columns: the model up to it, against the source")
    lines += textwrap.wrap("; ".join(ALONE.get(k, k) for k in kinds), 118, initial_indent="  ", subsequent_indent="  ")
    lines.append(kv_change(report["kv_cache_bytes_per_token"]))
    return lines


def runs_in(serving: dict[str, str]) -> str:
    """One short line: the engines that run the output and those that do not; each one's reason is in
    the report's `serving` and the card."""
    yes = [engine for engine, verdict in serving.items() if str(verdict).startswith("yes")]
    no = [engine for engine in serving if engine not in yes]
    line = "runs in: " + (", ".join(yes) or "none of the engines checked")
    if no:
        line += f"; not in: {', '.join(no)} (why: `serving` in attnkit_report.json)"
    return line


def format_report(report: dict) -> str:
    lines = format_steps(report)
    lines.append(f"{held_out(report.get('calibration'))}: {report['ppl']['before']:.4f} -> {report['ppl']['after']:.4f}  "
                 f"(RoPE frequencies: {report['load']['rope_frequencies']})")
    if report.get("params"):
        lines += format_params(report["params"])
    if report["settings"].get("report") == "final":
        lines.append("--report final: the intermediate steps were not measured (--report steps measures each)")
    if report.get("qk_norm_fold"):
        f = report["qk_norm_fold"]
        lines.append(f"QK-norm fold (lossy; the `exact` step's row): {HELD_OUT} {report['ppl']['before']:.4f} -> "
                     f"{f['ppl']:.4f}, KL {f['kl']:.4f}")
    if report.get("sliding_window"):
        w = report["sliding_window"]
        lines.append(f"sliding-window layers ({len(w['layers'])} of {len(report['layers'])}) kept as windows of "
                     f"{w['window']} tokens: their latent cache holds the last {w['window'] - 1}, as the source's KV cache")
    if report.get("serving"):
        lines.append(runs_in(report["serving"]))
    if report.get("kv_budget"):
        b = report["kv_budget"]
        lines.append(f"--kv-budget {b['fraction']}: chose kv_lora_rank {b['chosen']['kv_lora_rank']}, rope_dim "
                     f"{b['chosen']['rope_dim']} among {len(b['candidates'])} measured splits ({b['measured_on']})")
    return "\n".join(lines)

