"""Measured choices for `attnkit convert --to mla`: whole candidate conversions run side by side.

`evaluate` streams the source layer by layer once (after the shared RoPE-score pre-pass) and, per
layer, builds every candidate's low-rank stage (plus the query refit when asked) from the same
calibration moment, pushing each candidate's own hidden states through its converted layer. At
the end every candidate has final logits on the same rows: KL(source || candidate), perplexity.
`choose_split` uses it for `--kv-budget` (uniform splits, calibration rows); the per-layer rank
benchmark (`benchmarks/mla_layer_ranks.py`) uses it with per-layer ranks on held-out rows.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from attnkit.converters import mla, mla_refit
from attnkit.converters.mla_budget import budget_values, refine_candidates, split_candidates
from attnkit.converters.mla_metrics import ErrorStat, logits_metrics, relative_errors
from attnkit.converters.mla_native import deepseek_config
from attnkit.converters.rope import exact_rope_parameters, geometric_rope_parameters, source_rope, target_rope
from attnkit.data import pack_tokens
from attnkit.errors import AttnkitError
from attnkit.io import mla_pipeline as pipe
from attnkit.io.calib import embed_rows

REFIT_ROWS = 4  # calibration rows whose source attention gives the refit's distance weights


@dataclass
class Candidate:
    name: str
    rope_dim: int
    ranks: list[int]  # kv_lora_rank per layer, constant channel included
    refit: str = "off"  # off | attention | uniform


@dataclass
class Target:
    """What the exported config implies for one rope_dim: the slots' frequencies, scales."""

    inv_freq: torch.Tensor
    attention_scaling: float
    scale: float
    config: object = field(repr=False, default=None)


def target_for(src, s, rope_dim: int, counts: torch.Tensor | None, kv_lora_rank: int) -> Target:
    """The DeepSeek-V3 config of a conversion with this split, and the RoPE/scale it implies."""
    shape = src.shape
    src_inv, src_att = source_rope(src.family, src.hf_config)
    src_rope = dict(src.hf_config.rope_parameters or {})
    if s.rope_frequencies == "exact":
        slot_inv = src_inv[torch.arange(shape.d // 2).repeat_interleave(counts)]
        rope_params = exact_rope_parameters(slot_inv, float(src_rope.get("rope_theta", 10000.0)),
                                            int(src.config.get("max_position_embeddings", 4096)), src_att)
    else:
        rope_params = geometric_rope_parameters(src_rope)
    q_lora = shape.D + 1 if pipe._has_q_bias(src) else None
    cfg = deepseek_config(src.config, shape, rope_dim, kv_lora_rank, q_lora, rope_params, s.dtype_name)
    cfg._attn_implementation = "sdpa"
    inv, att = target_rope(cfg)
    with torch.device("meta"):
        scale = DeepseekV3Attention(cfg, 0).scaling
    return Target(inv, att, scale, cfg)


def rope_score_pass(src, s, calib: torch.Tensor, scratch: Path | None = None) -> list[torch.Tensor]:
    """Every layer's RoPE component scores, as the converter's own pre-pass computes them."""
    with _scratch_dir(scratch) as tmp:
        return pipe.rope_scores(src, s, calib, tmp)


class _scratch_dir(tempfile.TemporaryDirectory):
    """A temporary folder for calibration hidden states (`RowStore`) inside `parent` (None: the system's)."""

    def __init__(self, parent: Path | None):
        super().__init__(prefix="attnkit-scratch-", dir=parent)

    def __enter__(self) -> Path:
        return Path(super().__enter__())


def distance_weights(mode: str, aw, src, x: torch.Tensor, src_inv, src_att) -> torch.Tensor:
    """[H, T] distance weights of the query refit (see `attnkit.converters.mla_refit`), row by row."""
    if mode == "uniform":
        return mla_refit.uniform_distance_weights(x.shape[1], src.shape.H)
    per_row = [mla_refit.causal_attention_by_distance(aw, src.shape, row[None].cpu(), src_inv, src_att,
                                                      pipe._source_scale(src)) for row in x]
    return torch.stack(per_row).mean(0)


def prepare(argv: list[str]):
    """(source, settings, calibration rows, held-out rows) from `attnkit convert` arguments, for benchmarks."""
    from transformers import AutoConfig, AutoTokenizer

    from attnkit.cli import build_parser
    from attnkit.converters.architectures import describe
    from attnkit.io.calib import calibration_tokens
    from attnkit.io.checkpoint import LazyCheckpoint
    from attnkit.io.mla_settings import resolve_settings
    from attnkit.io.resolve import check_causal_lm, resolve_model

    args = build_parser().parse_args(["convert", "--to", "mla", *argv])
    path = resolve_model(args.model)
    config = check_causal_lm(path)
    hf_config = AutoConfig.from_pretrained(path)
    hf_config._attn_implementation = "sdpa"
    D, H = hf_config.hidden_size, hf_config.num_attention_heads
    G = getattr(hf_config, "num_key_value_heads", None) or H
    d = getattr(hf_config, "head_dim", None) or D // H
    ckpt = LazyCheckpoint(path)
    src = pipe.Source(path, config, hf_config, describe(config), ckpt, mla.Shape(D, H, G, d), "model.layers.")
    s = resolve_settings(args, src.shape, ckpt, config)
    calib, held_out, _ = calibration_tokens(AutoTokenizer.from_pretrained(path), s.calib, s.seq_len, s.calib_tokens,
                                            s.eval_tokens, s.seed)
    return src, s, calib, held_out


def refit_stage(p: mla.MLAParams, aw, plan, src, s, mom: torch.Tensor, x: torch.Tensor) -> mla.MLAParams:
    """The pipeline's `refit` stage: `p` with its NoPE query refit; x [B, T, D] are the layer's normed
    inputs on the first REFIT_ROWS calibration rows (the source's attention there gives the weights)."""
    src_inv, src_att = source_rope(src.family, src.hf_config)
    return refit_params(p, aw, plan, src, mom, distance_weights(s.refit_query, aw, src, x, src_inv, src_att), src_inv)


def weights_needed(candidates: list[Candidate]) -> set[str]:
    return {c.refit for c in candidates} - {"off"}


def refit_params(p: mla.MLAParams, aw, plan, src, mom, weights: torch.Tensor, src_inv) -> mla.MLAParams:
    return mla_refit.refit_query(p, mla_refit.rope_stage_keys(aw, plan, src.shape), mom,
                                 *mla_refit.mean_rotation(weights, src_inv))


def evaluate(src, s, calib: torch.Tensor, rows: torch.Tensor, candidates: list[Candidate], scores=None,
             desc: str = "candidates", scratch: Path | None = None) -> tuple[float, dict[str, dict]]:
    """(source perplexity, {candidate: kl, ppl, logits/attention errors}) on `rows` [N, seq_len].

    The calibration hidden states wait in a scratch file inside `scratch` (as in the converter);
    the candidates' own states on `rows` stay in memory (a few rows each)."""
    dev, fam = s.device, src.family
    positions = torch.arange(rows.shape[1], device=dev)  # rows may be longer than the calibration rows
    src_pe, cal_pe = pipe.source_pe(src, rows.shape[1], dev), pipe.source_pe(src, calib.shape[1], dev)
    scores = scores if scores is not None else rope_score_pass(src, s, calib, scratch)
    targets = {}
    for c in candidates:
        counts = mla.slot_counts(scores, c.rope_dim)
        targets[c.name] = (counts, target_for(src, s, c.rope_dim, counts, max(c.ranks)))
    h0 = embed_rows(src.ckpt, fam.embed + ".weight", rows).to(dev)
    streams = {"source": h0, **{c.name: h0.clone() for c in candidates}}
    attn_err = {c.name: ErrorStat() for c in candidates}
    with _scratch_dir(scratch) as tmp:
        h_cal = pipe._embedded(src, calib, tmp / "calib.f32")
        for layer in tqdm(range(src.config["num_hidden_layers"]), desc=desc, unit="layer"):
            _evaluate_layer(src, s, layer, h_cal, streams, candidates, targets, attn_err, positions, src_pe, cal_pe)
        h_cal.close()
    final_norm = src.ckpt.get(fam.final_norm + ".weight", dtype=torch.float32, device=dev)
    finals = {k: pipe._final_hidden(src, h, final_norm) for k, h in streams.items()}
    tied = bool(src.config.get("tie_word_embeddings", False))
    embed_name = fam.embed + ".weight"
    head_name = embed_name if tied or fam.lm_head + ".weight" not in src.ckpt else fam.lm_head + ".weight"
    src_ppl, results = logits_metrics(finals.pop("source"), finals, rows[:, 1:].reshape(-1).to(dev),
                                      lambda: pipe._head_chunks(src.ckpt, head_name, dev))
    for c in candidates:
        results[c.name].update(attn_rel_err_mean=attn_err[c.name].mean, rope_dim=c.rope_dim, ranks=c.ranks,
                               refit=c.refit)
    return src_ppl, results


def _evaluate_layer(src, s, layer: int, h_cal, streams: dict, candidates: list[Candidate], targets: dict,
                    attn_err: dict, positions, src_pe, cal_pe) -> None:
    """One layer of `evaluate`: every candidate's stage from the same moment; advances every stream."""
    shape, dev, fam = src.shape, s.device, src.family
    src_inv, src_att = source_rope(fam, src.hf_config)
    module = pipe._source_layer(src, layer, dev)
    norm1 = getattr(module, fam.norms[0])
    mom, aw = pipe._moment(module, fam, h_cal, shape, dev).value, pipe._cpu_weights(module, src)
    with torch.no_grad():
        x_w = norm1(h_cal.read(0, REFIT_ROWS).to(dev)) if weights_needed(candidates) else None
        weights = {m: distance_weights(m, aw, src, x_w, src_inv, src_att) for m in weights_needed(candidates)}
        x_src = norm1(streams["source"])
        ref = module.self_attn(hidden_states=x_src, position_embeddings=src_pe, attention_mask=None)[0]
        for c in candidates:
            counts, tgt = targets[c.name]
            plan = mla.plan_rope(aw, mom, shape, c.rope_dim, s.rope_method, src_inv, s.rope_frequencies,
                                 tgt.inv_freq, counts)
            split = mla.split_keys(aw, plan, shape)
            metrics = mla.attention_metrics(aw, split, shape, mom) if s.objective == "attention" else None
            p = mla.build_stage(aw, plan, shape, mom, scale_src=pipe._source_scale(src), scale_tgt=tgt.scale,
                                rope_src=src_att, rope_tgt=tgt.attention_scaling,
                                beta=mla.balance_factor(split, aw, mom, metrics), metrics=metrics,
                                rank=c.ranks[layer] - 1)
            if c.refit != "off":
                p = refit_params(p, aw, plan, src, mom, weights[c.refit], src_inv)
            attend, _ = pipe._mla_fn(p, positions, dev)
            attn_err[c.name].add(relative_errors(attend(x_src), ref))
            streams[c.name] = pipe._run_stage_layer(module, fam, attend, streams[c.name])
        streams["source"] = pipe._through(module, src_pe)(streams["source"])
    h_cal.map_(pipe._through(module, cal_pe), pipe.ROW_BATCH, dev)


def spectra_pass(src, s, calib: torch.Tensor, rope_dim: int, scores, scratch: Path | None = None) -> list[torch.Tensor]:
    """Every layer's descending latent PCA eigenvalues at this rope_dim (what each kept channel buys)."""
    shape, fam = src.shape, src.family
    src_inv, _ = source_rope(fam, src.hf_config)
    src_pe = pipe.source_pe(src, calib.shape[1], s.device)
    counts = mla.slot_counts(scores, rope_dim)
    tgt = target_for(src, s, rope_dim, counts, 2)
    spectra = []
    with _scratch_dir(scratch) as tmp:
        h_cal = pipe._embedded(src, calib, tmp / "calib.f32")
        for layer in tqdm(range(src.config["num_hidden_layers"]), desc="latent spectra", unit="layer"):
            module = pipe._source_layer(src, layer, s.device)
            mom, aw = pipe._moment(module, fam, h_cal, shape, s.device).value, pipe._cpu_weights(module, src)
            plan = mla.plan_rope(aw, mom, shape, rope_dim, s.rope_method, src_inv, s.rope_frequencies, tgt.inv_freq, counts)
            split = mla.split_keys(aw, plan, shape)
            metrics = mla.attention_metrics(aw, split, shape, mom) if s.objective == "attention" else None
            latent = mla.latent_rows(split, aw, mla.balance_factor(split, aw, mom, metrics), metrics)
            spectra.append(mla.latent_spectrum(latent, mom))
            h_cal.map_(pipe._through(module, src_pe), pipe.ROW_BATCH, s.device)
        h_cal.close()
    return spectra


def selection_rows(tokenizer, s, calib: torch.Tensor, n_held: int) -> tuple[torch.Tensor, str]:
    """Rows to choose on: validation text after the report's held-out rows (so the report stays an
    unbiased check), else calibration rows (a small model may have memorised its training text)."""
    n_sel = max(2, s.eval_tokens // s.seq_len)
    try:
        more = pack_tokens(tokenizer, s.calib, "validation", s.seq_len, (n_held + n_sel) * s.seq_len, s.seed)
    except AttnkitError:
        more = calib[:0]
    if more.shape[0] > n_held:
        return more[n_held:], f"{more.shape[0] - n_held} validation rows after the report's held-out rows"
    return calib[: min(calib.shape[0], n_sel)], f"{min(calib.shape[0], n_sel)} calibration rows (no spare validation text)"


def choose_split(src, s, calib: torch.Tensor, tokenizer, n_held: int,
                 scratch: Path | None = None) -> tuple[dict, list[torch.Tensor]]:
    """--kv-budget: the uniform (kv_lora_rank, rope_dim) split with the lowest KL(source || converted)
    on selection rows (`selection_rows`), among an even grid of rope_dim and a refinement around the
    best. Sets s.kv_lora_rank / s.rope_dim; returns the report's `kv_budget` section and the RoPE
    scores (the conversion reuses them). Scratch files go in a temporary folder inside `scratch`."""
    shape, layers = src.shape, src.config["num_hidden_layers"]
    total = budget_values(shape, s.kv_budget)
    rope_cap = shape.d if s.rope_frequencies == "geometric" else shape.G * shape.d
    splits = split_candidates(shape, total, rope_cap)
    if not splits:
        raise AttnkitError(f"--kv-budget {s.kv_budget} is too small for this model ({total} values per token and layer)")
    rows, rows_note = selection_rows(tokenizer, s, calib, n_held)
    scores = rope_score_pass(src, s, calib, scratch)
    table = {}
    for round_ in range(2):
        cands = [Candidate(f"r{r}_dr{dr}", dr, [r] * layers, s.refit_query) for r, dr in splits]
        _, res = evaluate(src, s, calib, rows, cands, scores, desc=f"kv-budget candidates ({round_ + 1}/2)",
                          scratch=scratch)
        table.update(res)
        best = min(table.values(), key=lambda m: m["kl"])
        splits = refine_candidates(shape, total, [m["rope_dim"] for m in table.values()], best["rope_dim"], rope_cap)
        if not splits:
            break
    best = min(table.values(), key=lambda m: m["kl"])
    s.kv_lora_rank, s.rope_dim = best["ranks"][0], best["rope_dim"]
    rows_out = sorted(({"kv_lora_rank": m["ranks"][0], "rope_dim": m["rope_dim"], "kl": m["kl"], "ppl": m["ppl"],
                        "attn_rel_err_mean": m["attn_rel_err_mean"]} for m in table.values()), key=lambda m: m["rope_dim"])
    print(format_table(rows_out, s.kv_lora_rank, s.rope_dim, total, 2 * shape.G * shape.d))
    section = {"fraction": s.kv_budget, "values_per_token_layer": total, "measured_on": rows_note,
               "chosen": {"kv_lora_rank": s.kv_lora_rank, "rope_dim": s.rope_dim}, "candidates": rows_out}
    return section, scores


def format_table(rows: list[dict], rank: int, rope_dim: int, total: int, full: int) -> str:
    lines = [f"--kv-budget: {total} of {full} cached values per token and layer; candidates (KL on selection rows):",
             f"{'kv_lora_rank':>13}{'rope_dim':>10}{'KL':>11}{'ppl':>10}{'attn err':>11}"]
    for r in rows:
        mark = "  <- chosen" if (r["kv_lora_rank"], r["rope_dim"]) == (rank, rope_dim) else ""
        lines.append(f"{r['kv_lora_rank']:>13}{r['rope_dim']:>10}{r['kl']:>11.4f}{r['ppl']:>10.3f}"
                     f"{r['attn_rel_err_mean']:>11.4f}{mark}")
    return "\n".join(lines)
