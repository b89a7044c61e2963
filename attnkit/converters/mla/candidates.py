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
from dataclasses import dataclass
from pathlib import Path

import torch

from attnkit.converters.common import calibration_tokens
from attnkit.converters.mla import layer as mla
from attnkit.converters.mla.budget import (KL_TIE, budget_values, max_rank, preferred, refine_candidates,
                                          split_candidates)
from attnkit.converters.mla.metrics import ErrorStat, relative_errors
from attnkit.converters.mla.engines import VLLM_CPU_MLA_SIZE, VLLM_MLA_SIZES, VLLM_ROPE_DIM, ladder_stride, vllm_splits
from attnkit.converters.mla.native import target_for
from attnkit.converters.mla.progress import ConversionProgress, pre_pass_rows
from attnkit.converters.mla.refit import REFIT_ROWS, distance_weights, layer_damping, refit_params, rope_damping
from attnkit.converters.mla.rope import source_rope
from attnkit.converters.mla.settings import Settings, resolve_settings, rope_cap
from attnkit.converters.measure import final_metrics
from attnkit.converters.mla.source import (ROW_BATCH, Source, cpu_weights, embedded, lm_head_name,
                                           layer_norms, layer_rope, layer_view, layer_window, moment, open_source,
                                           run_stage_layer, source_pe, source_scale, through, view_moment, window_mask)
from attnkit.converters.stream.engine import last_layer, stream_layers
from attnkit.errors import AttnkitError
from attnkit.converters.stream.rowstore import RowStore


@dataclass
class Candidate:
    name: str
    rope_dim: int
    ranks: list[int]  # kv_lora_rank per layer, constant channel included
    refit: str = "off"  # off | attention | uniform


def rope_score_pass(src, s, calib: torch.Tensor, scratch: Path | None = None,
                    progress: ConversionProgress | None = None) -> list[torch.Tensor]:
    """Pre-pass: every layer's RoPE component scores (`layer.slot_counts` turns them into slots per
    frequency for a rope_dim, `engines.ladder_stride` into the stride of a plain ladder).

    Scores only rank components, so a quarter of the calibration rows (at least 4) is enough; the
    loss scores' damping comes from the same first REFIT_ROWS rows as in the converter's pass.
    `progress`: the conversion's bar to advance (else a bar of its own)."""
    with _scratch_dir(scratch) as tmp:
        h = embedded(src, calib[: pre_pass_rows(calib.shape[0])], tmp / "rope-prepass.f32")
        desc = "rope scores" if progress is not None else f"{src.path.name}: rope scores (pre-pass)"
        # the last layer's output is not read: neither is its MLP
        scores = stream_layers(src, s.device, lambda layer, module: _rope_scores_layer(src, s, layer, module, h), desc,
                               progress=progress, mlp="not last")
        h.close()
    return scores


def _rope_scores_layer(src, s, layer: int, module: torch.nn.Module, h: RowStore) -> torch.Tensor:
    """The pre-pass's hook: one layer's RoPE component scores; advances `h` through the layer."""
    src_pe = source_pe(src, h.row_shape[0], s.device, layer)
    view = layer_view(src, s.format, module, h, src_pe, s.device)
    mom = view_moment(module, src, view, h, s.device).value
    first = lambda: view.attn_input(layer_norms(module, src.family)[0](h.read(0, REFIT_ROWS).to(s.device)))  # noqa: E731
    damping = layer_damping(s, view.aw, src, first, layer_rope(src, layer), layer_window(src, layer))
    scores = mla.rope_scores(view.aw, mom, view.shape, s.rope_method, damping)[1]
    if not last_layer(src, layer):
        mask = window_mask(h.row_shape[0], layer_window(src, layer), s.device)
        h.map_(through(module, src_pe, mask), ROW_BATCH, s.device)
    return scores


def rope_slots(scores: list[torch.Tensor], frequencies: str, d: int, rope_dim: int) -> tuple[torch.Tensor | None, int]:
    """(RoPE slots per source frequency, stride of the plain ladder) at rope_dim, each computed only
    where the frequencies use it (exact: counts; ladder: stride; a ladder has no stride past d)."""
    counts = mla.slot_counts(scores, rope_dim) if frequencies == "exact" else None
    stride = ladder_stride(scores, d, rope_dim) if frequencies == "ladder" else 1
    return counts, stride


class _scratch_dir(tempfile.TemporaryDirectory):
    """A temporary folder for calibration hidden states (`RowStore`) inside `parent` (None: the system's)."""

    def __init__(self, parent: Path | None):
        super().__init__(prefix="attnkit-scratch-", dir=parent)

    def __enter__(self) -> Path:
        return Path(super().__enter__())


def prepare(argv: list[str]) -> tuple[Source, Settings, torch.Tensor, torch.Tensor]:
    """(source, settings, calibration rows, held-out rows) from `attnkit convert` arguments, for benchmarks."""
    from transformers import AutoTokenizer

    from attnkit.cli import build_parser

    args = build_parser().parse_args(["convert", "--to", "mla", *argv])
    src = open_source(args.model, calib_dtype=args.calib_dtype, device=args.device)
    s = resolve_settings(args, src.shape, src.dtype)
    calib, held_out, _ = calibration_tokens(AutoTokenizer.from_pretrained(src.path), s.calib, s.seq_len, s.calib_tokens,
                                            s.eval_tokens, s.seed)
    return src, s, calib, held_out


def weights_needed(candidates: list[Candidate]) -> set[str]:
    return {c.refit for c in candidates} - {"off"}


def evaluate(src, s, calib: torch.Tensor, rows: torch.Tensor, candidates: list[Candidate], scores=None,
             desc: str = "candidates", scratch: Path | None = None) -> tuple[float, dict[str, dict]]:
    """(source perplexity, {candidate: kl, ppl, logits/attention errors}) on `rows` [N, seq_len].

    The calibration hidden states wait in a scratch file inside `scratch` (as in the converter);
    the candidates' own states on `rows` stay in memory (a few rows each)."""
    dev, fam = s.device, src.family
    positions = torch.arange(rows.shape[1], device=dev)  # rows may be longer than the calibration rows
    src_pe, cal_pe = source_pe(src, rows.shape[1], dev), source_pe(src, calib.shape[1], dev)
    scores = scores if scores is not None else rope_score_pass(src, s, calib, scratch)
    targets = {}
    for c in candidates:
        counts, stride = rope_slots(scores, s.rope_frequencies, src.shape.d, c.rope_dim)
        targets[c.name] = (counts, stride, target_for(src, s, c.rope_dim, counts, max(c.ranks), stride))
    attn_err = {c.name: ErrorStat() for c in candidates}
    with _scratch_dir(scratch) as tmp:
        rows_in = embedded(src, rows, tmp / "rows.f32")  # the candidates' rows: a few, held in memory from here
        h0 = rows_in.all().to(dev)  # [N, seq_len, D]
        rows_in.close()
        streams = {"source": h0, **{c.name: h0.clone() for c in candidates}}
        h_cal = embedded(src, calib, tmp / "calib.f32")
        stream_layers(src, dev, lambda layer, module: _evaluate_layer(src, s, layer, module, h_cal, streams, candidates,
                                                                      targets, attn_err, positions, src_pe, cal_pe), desc)
        h_cal.close()
    final_norm = src.ckpt.get(fam.final_norm + ".weight", dtype=torch.float32, device=dev)
    src_ppl, results = final_metrics(src, streams, [c.name for c in candidates], rows, final_norm, lm_head_name(src), dev)
    for c in candidates:
        results[c.name].update(attn_rel_err_mean=attn_err[c.name].mean, rope_dim=c.rope_dim, ranks=c.ranks,
                               refit=c.refit)
    return src_ppl, results


def _evaluate_layer(src, s, layer: int, module: torch.nn.Module, h_cal: RowStore, streams: dict,
                    candidates: list[Candidate], targets: dict, attn_err: dict, positions, src_pe, cal_pe) -> None:
    """`evaluate`'s hook: every candidate's stage of one layer from the same moment; advances every stream."""
    shape, dev, fam = src.shape, s.device, src.family
    src_inv, src_att = source_rope(fam, src.hf_config)
    norm1 = layer_norms(module, fam)[0]
    view = layer_view(src, s.format, module, h_cal, cal_pe, dev)  # QK norms lifted or folded, as the converter's
    mom, aw, shape = view_moment(module, src, view, h_cal, dev).value, view.aw, view.shape
    with torch.no_grad():
        modes = weights_needed(candidates) | ({s.refit_query} if s.rope_score == "loss" else set())
        x_w = view.attn_input(norm1(h_cal.read(0, REFIT_ROWS).to(dev))) if modes else None
        weights = {m: distance_weights(m, aw, src, x_w, src_inv, src_att) for m in modes}
        damping = rope_damping(weights[s.refit_query], src_inv) if s.rope_score == "loss" else None
        x_src = norm1(streams["source"])
        ref = module.self_attn(hidden_states=x_src, position_embeddings=src_pe, attention_mask=None)[0]
        for c in candidates:
            counts, stride, tgt = targets[c.name]
            plan = mla.plan_rope(aw, mom, shape, c.rope_dim, s.rope_method, src_inv, s.rope_frequencies,
                                 tgt.inv_freq, counts, stride, damping)
            split = mla.split_keys(aw, plan, shape)
            metrics = mla.attention_metrics(aw, split, shape, mom) if s.objective == "attention" else None
            p = mla.build_stage(aw, plan, shape, mom, scale_src=source_scale(src), scale_tgt=tgt.scale,
                                rope_src=src_att, rope_tgt=tgt.attention_scaling,
                                beta=mla.balance_factor(split, aw, mom, metrics), metrics=metrics,
                                rank=c.ranks[layer] - s.norm_channel, centred=s.target != "engines")
            if c.refit != "off":
                p = refit_params(p, aw, plan, src, mom, weights[c.refit], src_inv)
            attend = view.wrap(mla.attention_fn(p, positions, dev)[0])  # on the normed hidden states
            attn_err[c.name].add(relative_errors(attend(x_src), ref))
            streams[c.name] = run_stage_layer(module, fam, attend, streams[c.name])
        streams["source"] = through(module, src_pe)(streams["source"])
    h_cal.map_(through(module, cal_pe), ROW_BATCH, dev)


def spectra_pass(src, s, calib: torch.Tensor, rope_dim: int, scores, scratch: Path | None = None) -> list[torch.Tensor]:
    """Every layer's descending latent PCA eigenvalues at this rope_dim (what each kept channel buys)."""
    counts, stride = rope_slots(scores, s.rope_frequencies, src.shape.d, rope_dim)
    tgt = target_for(src, s, rope_dim, counts, 2, stride)
    src_pe = source_pe(src, calib.shape[1], s.device)
    with _scratch_dir(scratch) as tmp:
        h_cal = embedded(src, calib, tmp / "calib.f32")
        spectra = stream_layers(src, s.device, lambda layer, module: _spectrum_layer(
            src, s, module, h_cal, rope_dim, tgt.inv_freq, counts, stride, src_pe), "latent spectra")
        h_cal.close()
    return spectra


def _spectrum_layer(src, s, module: torch.nn.Module, h_cal: RowStore, rope_dim: int, tgt_inv: torch.Tensor,
                    counts, stride: int, src_pe) -> torch.Tensor:
    """`spectra_pass`'s hook: one layer's latent spectrum; advances `h_cal` through the layer."""
    shape, fam = src.shape, src.family
    rope = source_rope(fam, src.hf_config)  # (inv_freq, attention scaling)
    mom, aw = moment(module, fam, h_cal, shape, s.device).value, cpu_weights(module, src)
    first = lambda: getattr(module, fam.norms[0])(h_cal.read(0, REFIT_ROWS).to(s.device))  # noqa: E731
    damping = layer_damping(s, aw, src, first, rope)
    plan = mla.plan_rope(aw, mom, shape, rope_dim, s.rope_method, rope[0], s.rope_frequencies, tgt_inv, counts,
                         stride, damping)
    split = mla.split_keys(aw, plan, shape)
    metrics = mla.attention_metrics(aw, split, shape, mom) if s.objective == "attention" else None
    latent = mla.latent_rows(split, aw, mla.balance_factor(split, aw, mom, metrics), metrics)
    spectrum = mla.latent_spectrum(latent, mom)
    h_cal.map_(through(module, src_pe), ROW_BATCH, s.device)
    return spectrum


def selection_tokens(s) -> int:
    """How many tokens `--kv-budget` chooses on (`calibration_text`'s spare rows): at least two rows."""
    return max(2, s.eval_tokens // s.seq_len) * s.seq_len


def selection_rows(s, calib: torch.Tensor, spare: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Rows to choose on: validation text after the report's held-out rows (`spare`, so the report stays an
    unbiased check), else calibration rows (a small model may have memorised its training text)."""
    if spare.shape[0] > 0:
        return spare, f"{spare.shape[0]} validation rows after the report's held-out rows"
    n_sel = selection_tokens(s) // s.seq_len
    return calib[: min(calib.shape[0], n_sel)], f"{min(calib.shape[0], n_sel)} calibration rows (no spare validation text)"


def choose_split(src, s, calib: torch.Tensor, spare: torch.Tensor,
                 scratch: Path | None = None) -> tuple[dict, list[torch.Tensor]]:
    """--kv-budget: the uniform (kv_lora_rank, rope_dim) split with the lowest KL(source || converted)
    on selection rows (`selection_rows`), among an even grid of rope_dim and a refinement around the
    best; of the splits within `KL_TIE` of that KL, the widest RoPE key (`budget.preferred`). Sets
    s.kv_lora_rank / s.rope_dim; returns the report's `kv_budget` section and the RoPE scores (the
    conversion reuses them). Scratch files go in a temporary folder inside `scratch`."""
    shape, layers = src.shape, src.config["num_hidden_layers"]
    total = budget_values(shape, s.kv_budget)
    cap = rope_cap(shape, s.rope_frequencies)
    if s.engine_sizes:  # only what the engine's kernels take: a few fixed sizes, nothing to refine
        splits = vllm_splits(total, max_rank(shape, VLLM_ROPE_DIM) - (not s.norm_channel), cap, s.engine_sizes == "vllm-cpu")
        if not splits:
            sizes = VLLM_CPU_MLA_SIZE if s.engine_sizes == "vllm-cpu" else "/".join(map(str, VLLM_MLA_SIZES))
            raise AttnkitError(f"no split {s.engine_sizes}'s MLA kernels take fits --kv-budget {s.kv_budget}: they cache "
                               f"kv_lora_rank + {VLLM_ROPE_DIM} = {sizes} values per token and layer, the budget allows "
                               f"{total} of this model's {2 * shape.G * shape.d} (head_dim {shape.d})")
    else:
        splits = split_candidates(shape, total, cap, norm_channel=s.norm_channel)
    if not splits:
        raise AttnkitError(f"--kv-budget {s.kv_budget} is too small for this model ({total} values per token and layer)")
    rows, rows_note = selection_rows(s, calib, spare)
    scores = rope_score_pass(src, s, calib, scratch)
    table = {}
    for round_ in range(2):
        cands = [Candidate(f"r{r}_dr{dr}", dr, [r] * layers, s.refit_query) for r, dr in splits]
        _, res = evaluate(src, s, calib, rows, cands, scores, desc=f"kv-budget candidates ({round_ + 1}/2)",
                          scratch=scratch)
        table.update(res)
        best = min(table.values(), key=lambda m: m["kl"])
        splits = [] if s.engine_sizes else refine_candidates(shape, total, [m["rope_dim"] for m in table.values()],
                                                             best["rope_dim"], cap, norm_channel=s.norm_channel)
        if not splits:
            break
    rows_out = sorted(({"kv_lora_rank": m["ranks"][0], "rope_dim": m["rope_dim"], "kl": m["kl"], "ppl": m["ppl"],
                        "attn_rel_err_mean": m["attn_rel_err_mean"]} for m in table.values()), key=lambda m: m["rope_dim"])
    best = preferred(rows_out)[0]  # the least KL, or of the splits tied with it the widest RoPE key
    s.kv_lora_rank, s.rope_dim = best["kv_lora_rank"], best["rope_dim"]
    print(format_table(rows_out, s.kv_lora_rank, s.rope_dim, total, 2 * shape.G * shape.d))
    section = {"fraction": s.kv_budget, "values_per_token_layer": total, "measured_on": rows_note,
               "chosen": {"kv_lora_rank": s.kv_lora_rank, "rope_dim": s.rope_dim}, "kl_tie": KL_TIE,
               "candidates": rows_out}
    return section, scores


def format_table(rows: list[dict], rank: int, rope_dim: int, total: int, full: int) -> str:
    lines = [f"--kv-budget: {total} of {full} cached values per token and layer; candidates (KL on selection rows; "
             f"within {KL_TIE:.0%} of the least, the widest RoPE key is chosen):",
             f"{'kv_lora_rank':>13}{'rope_dim':>10}{'KL':>11}{'ppl':>10}{'attn err':>11}"]
    for r in rows:
        mark = "  <- chosen" if (r["kv_lora_rank"], r["rope_dim"]) == (rank, rope_dim) else ""
        lines.append(f"{r['kv_lora_rank']:>13}{r['rope_dim']:>10}{r['kl']:>11.4f}{r['ppl']:>10.3f}"
                     f"{r['attn_rel_err_mean']:>11.4f}{mark}")
    return "\n".join(lines)
