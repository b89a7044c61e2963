"""`attnkit convert --to mla`: the streaming driver, as a plan and its execution.

`plan` fixes everything a conversion shares before any layer is read: settings, calibration
and held-out rows, the measured split (`--kv-budget`), the RoPE pre-pass, and the DeepSeek-V3
target (`native.target_for`). `execute` then streams the source layer by layer: read the layer's
attention, accumulate the input moment on calibration hidden states, build every stage of the
conversion and run the held-out text through each stage's attention (to measure its error); drop
the stages, load the layer's MLP, finish the layer for every stream and write the DeepSeek-V3
tensors. Only one layer's weights are ever resident, and the hidden states (calibration and
held-out) wait in scratch files (`RowStore`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoTokenizer
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from attnkit.converters.common import calibration_text, check_device
from attnkit.converters.measure import SourceAttention, measure_stage, measure_streams, return_freed_memory
from attnkit.converters.mla import fit_choice, heal_choice, layer as mla
from attnkit.converters.mla.candidates import choose_split, rope_score_pass, rope_slots, selection_tokens
from attnkit.converters.mla.legacy import legacy_fields, legacy_tokenizer_fields, min_transformers
from attnkit.converters.mla.metrics import ErrorStat
from attnkit.converters.mla.engine_fit import engine_tensors
from attnkit.converters.mla.engines import pad_value_heads
from attnkit.converters.mla.fit import fit_attention
from attnkit.converters.mla.progress import ConversionProgress
from attnkit.converters.mla.native import (Target, constant_for, native_attention_tensors, target_for,
                                           written_attention)
from attnkit.converters.mla.qknorm import attnkit_tensors, format_note, write_code
from attnkit.converters.mla.refit import REFIT_ROWS, distance_weights, refit_params, rope_damping
from attnkit.converters.mla.report import build_report, format_report, params_why
from attnkit.converters.params import parameter_report
from attnkit.converters.mla.settings import Settings, resolve_settings
from attnkit.converters.mla.source import (ROW_BATCH, Source, embedded, has_q_bias,
                                           layer_norms, layer_rope, layer_tensors, layer_type, layer_view, layer_window,
                                           lm_head_name, open_source, rope_tables, source_pe,
                                           source_scale, view_moment, window_mask)
from attnkit.converters.stream.engine import finish_layer, last_layer, stream_layers
from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import LazyCheckpoint, ShardedWriter, atomic_output_dir
from attnkit.card.build import write_model_card
from attnkit.converters.stream.rowstore import RowStore
from attnkit.converters.stream.outside import write_outside_layers

STAGES = ("exact", "rope", "balance", "low-rank", "native")
REFIT_STAGES = ("exact", "rope", "balance", "low-rank", "refit", "native")  # with --refit-query
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
              "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


@dataclass
class Plan:
    """Everything a conversion decides before the first layer is read."""

    src: Source
    s: Settings
    calib: torch.Tensor  # [N, T] calibration token rows
    held_out: torch.Tensor  # [M, T] held-out rows of the per-step report
    held_note: str
    target: Target
    counts: torch.Tensor | None  # RoPE slots per source frequency (exact frequencies)
    stride: int  # of the kept source frequency pairs (ladder frequencies)
    budget: dict | None  # the report's `kv_budget` section
    progress: ConversionProgress  # one bar over the pre-pass and the conversion


def convert(args: argparse.Namespace) -> int:
    if measured_choice(args) != "kl":
        return convert_choosing(args)
    started = time.time()
    return_freed_memory()
    src = open_source(args.model, calib_dtype=args.calib_dtype, device=args.device)
    with atomic_output_dir(args.out, args.force, (src.path,)) as tmp:  # OUT is claimed; a refusal below leaves nothing
        s = resolve_settings(args, src.shape, src.dtype, src.family)
        check_device(s.device)
        if note := format_note(src.family, s.format):
            print(note)
        _check_disk(src.nbytes, s, tmp)
        scratch = tmp / ".scratch"
        scratch.mkdir()
        try:
            p = plan(src, s, scratch)
            report = execute(p, tmp, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        report["source"]["model"] = args.model
        if p.budget is not None:
            report["kv_budget"] = p.budget
        report["calibration"].update(**src.calib_note, held_out_from=p.held_note, calib_rows=int(p.calib.shape[0]),
                                     held_out_rows=int(p.held_out.shape[0]))
        report["params"] = parameter_report(src.ckpt.shapes(), LazyCheckpoint(tmp).shapes(), params_why(report, src.shape))
        report["wall_time_s"] = round(time.time() - started, 2)
        for name in COPY_FILES:
            if (src.path / name).is_file():
                shutil.copy2(src.path / name, tmp / name)
        if s.format == "attnkit":
            write_code(tmp)
        else:
            report["load"]["min_transformers"] = _write_legacy_fields(tmp)
        (tmp / "attnkit_report.json").write_text(json.dumps(report, indent=2))
        write_model_card(tmp)
    print(format_report(report))
    if getattr(args, "announce", True):  # not when OUT is a scratch step of `mla+…` (its path is temporary)
        print(f"wrote {args.out}")
    return 0


def measured_choice(args: argparse.Namespace) -> str:
    """--choose-by as it applies: auto is fit when the layer fit runs under --kv-budget (the KL ranking is
    the closed form's, and the fit re-ranks splits), else kl; no choice without --kv-budget but heal/fit's
    own refusal."""
    by = getattr(args, "choose_by", "kl") or "kl"
    if by == "auto":
        fits = getattr(args, "kv_budget", None) is not None and getattr(args, "fit_steps", 0)
        return "fit" if fits and not getattr(args, "engine_sizes", None) else "kl"
    return by


def convert_choosing(args: argparse.Namespace) -> int:
    """--kv-budget F --choose-by heal|fit: splits converted and measured after training (`heal_choice`, a short
    heal; `fit_choice`, the layer fit); the best is written to OUT, its report's `kv_budget` naming every split
    measured and its figures."""
    started, by = time.time(), measured_choice(args)
    if by == "heal":
        recipe = heal_choice.check_recipe(args)  # refused before OUT is claimed
    else:
        fit_choice.check(args)
    src = open_source(args.model)
    with atomic_output_dir(args.out, args.force, (src.path,)) as tmp:
        if by == "heal":
            budget, line = heal_choice.choose_by_heal(args, convert, tmp, recipe, teacher=str(src.path))
        else:
            budget, line = fit_choice.choose_by_fit(args, convert, tmp)
        report = json.loads((tmp / "attnkit_report.json").read_text())
        report["kv_budget"] = budget
        report["wall_time_s"] = round(time.time() - started, 2)  # every split converted, not only the one written
        (tmp / "attnkit_report.json").write_text(json.dumps(report, indent=2))
        write_model_card(tmp)
    print(line)
    print(f"wrote {args.out}")
    return 0


def plan(src: Source, s: Settings, scratch: Path) -> Plan:
    """Calibration rows, the split (measured when --kv-budget), the RoPE pre-pass, the target."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.path)
    except Exception as exc:
        raise AttnkitError(f"cannot load the tokenizer of {src.path}: {str(exc).splitlines()[0]}") from None
    spare = selection_tokens(s) if s.kv_budget is not None else 0
    text = calibration_text(tokenizer, s.calib, s.seq_len, s.calib_tokens, s.eval_tokens, s.seed, n_spare=spare)
    calib, held_out, held_note = text.calib, text.held_out, text.note
    scores, budget = None, None
    if s.kv_budget is not None:  # measured choice of (kv_lora_rank, rope_dim); sets them in s
        budget, scores = choose_split(src, s, calib, text.spare, scratch)
    return_freed_memory(trim=True)
    pre_pass = scores is None and s.rope_frequencies != "geometric"
    progress = ConversionProgress(src.path.name, src.config["num_hidden_layers"], calib.shape[0], pre_pass)
    if pre_pass:
        scores = rope_score_pass(src, s, calib, scratch, progress)
    counts, stride = rope_slots(scores, s.rope_frequencies, src.shape.d, s.rope_dim)
    target = target_for(src, s, s.rope_dim, counts, s.kv_lora_rank, stride)
    return Plan(src, s, calib, held_out, held_note, target, counts, stride, budget, progress)


def _write_legacy_fields(folder: Path) -> str:
    """What transformers 4.x reads (config `rope_theta` / `rope_scaling`, a tokenizer class it knows),
    written beside transformers 5's fields; returns the oldest release that loads the output."""
    config = json.loads((folder / "config.json").read_text())
    config.update(legacy_fields(config))
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok_path = folder / "tokenizer_config.json"
    if tok_path.is_file():
        tok = json.loads(tok_path.read_text())
        if legacy_tokenizer_fields(tok):
            tok_path.write_text(json.dumps({**tok, **legacy_tokenizer_fields(tok)}, indent=2) + "\n")
    return min_transformers(config)


def _check_disk(src_bytes: int, s: Settings, tmp: Path) -> None:
    """Refuse before any work when the output (about the source's size, in the output dtype) would not fit."""
    estimate = int(src_bytes * s.out_dtype.itemsize / max(1, s.src_itemsize) * 1.1) + (1 << 20)
    parent = tmp.parent
    free = shutil.disk_usage(parent).free
    if free < estimate:
        raise AttnkitError(f"not enough disk space in {parent}: need about {estimate / 1e9:.2f} GB, {free / 1e9:.2f} GB free")


@dataclass
class _Layers:
    """What every layer's conversion shares: the target, positions, RoPE tables, the writer."""

    target: Target
    positions: torch.Tensor
    src_pe: tuple
    tgt_pe: tuple
    src_inv: torch.Tensor
    counts: torch.Tensor | None
    stride: int
    engine: bool
    kw: dict  # scales and RoPE attention factors of build_stage
    q_bias: bool
    writer: ShardedWriter
    built: tuple[str, ...]  # the stages this run builds (a measured stage is also in the streams)
    # a family with RoPE per layer type (Gemma-3): type -> (inv_freq, attention scaling, (cos, sin));
    # `_at_layer` sets the layer's own, and its sliding window and mask (None: full causal attention)
    by_type: dict | None = None
    window: int | None = None
    mask: torch.Tensor | None = None


def execute(p: Plan, tmp: Path, scratch: Path) -> dict:
    """Stream the source through the plan into `tmp`; returns the report."""
    src, s = p.src, p.s
    shape, dev, fam = src.shape, s.device, src.family
    src_inv, src_att = layer_rope(src, 0)
    tgt_cfg = p.target.config
    src_pe = source_pe(src, s.seq_len, dev, 0)  # the attnkit format rotates with the source's own tables
    t = _Layers(p.target, torch.arange(s.seq_len, device=dev), src_pe,
                src_pe if s.format == "attnkit" else rope_tables(DeepseekV3RotaryEmbedding(tgt_cfg), s.seq_len, shape.D, dev),
                src_inv, p.counts,
                p.stride, s.target == "engines", dict(scale_src=source_scale(src), scale_tgt=p.target.scale, rope_src=src_att,
                     rope_tgt=p.target.attention_scaling),
                has_q_bias(src), ShardedWriter(tmp, max_shard_bytes=s.max_shard_bytes),
                STAGES if s.refit_query == "off" else REFIT_STAGES)
    if fam.by_layer_type:
        firsts = {layer_type(src, i): i for i in reversed(range(src.config["num_hidden_layers"]))}
        t.by_type = {k: (*layer_rope(src, i), source_pe(src, s.seq_len, dev, i)) for k, i in firsts.items()}
    h_cal = embedded(src, p.calib, scratch / "calib.f32")
    h0 = embedded(src, p.held_out, scratch / "source.f32")
    stages = measured_stages(t.built, s.report, fam.qk_norm is not None and s.format == "deepseek_v3")
    streams = {"source": h0, **{k: h0.copy(scratch / f"{k}.f32") for k in stages}}
    attn_err = {k: ErrorStat() for k in stages}
    per_layer = stream_layers(src, dev, lambda layer, module: _convert_layer(src, s, t, layer, module, h_cal, streams,
                                                                             attn_err), "convert",
                              progress=p.progress, mlp="deferred")
    p.progress.close()
    h_cal.close()
    head_name = lm_head_name(src)
    outside = {"model.norm.weight": fam.final_norm + ".weight", "model.embed_tokens.weight": fam.embed + ".weight"}
    if not src.config.get("tie_word_embeddings", False) or t.engine:  # the engine export writes its head (vLLM does not tie DeepSeek's)
        outside["lm_head.weight"] = head_name
    write_outside_layers(src, tmp, t.writer, s.out_dtype, outside, stream_above=0)
    final_norm = src.ckpt.get(fam.final_norm + ".weight", dtype=torch.float32, device=dev)
    tgt_cfg.to_json_file(str(tmp / "config.json"))
    src_ppl, metrics = measure_streams(src, streams, stages, p.held_out, final_norm, head_name, dev)
    report = build_report(src, s, tgt_cfg, metrics, attn_err, src_ppl, per_layer)
    if s.rope_frequencies == "ladder":
        report["target"]["rope_stride"] = p.stride
    return report


def measured_stages(built: tuple[str, ...], report: str, folded: bool) -> tuple[str, ...]:
    """The stages run end to end on the held-out text: all of them (`--report steps`), or only the
    written model (`final`; with QK norms folded also `exact`, the norm step's loss, never silent).
    The tensors do not depend on it: what the output needs is built either way."""
    if report == "steps":
        return built
    return tuple(k for k in built if k == "native" or (k == "exact" and folded))


def _convert_layer(src: Source, s: Settings, t: _Layers, layer: int, module: torch.nn.Module, h_cal: RowStore,
                   streams: dict[str, RowStore], attn_err: dict[str, ErrorStat]) -> dict:
    """The streaming engine's hook: convert, measure and write one layer (`module`, its MLP not yet
    read); advances `h_cal` and every stream through it.

    Two phases, so that the stages and the MLP are never resident together: (1) attention only —
    moment, stages, their errors, every stream's attention residual; (2) the MLP (`finish_layer`).
    A function of its own so that everything the layer allocated is freed when it returns."""
    shape, dev, fam = src.shape, s.device, src.family
    t = _at_layer(src, s, t, layer)
    norms = layer_norms(module, fam)  # h + post1(attn(norm1(h))), h + post2(mlp(norm2(h)))
    norm1, post1 = norms[:2]
    view = layer_view(src, s.format, module, h_cal, t.src_pe, dev)  # QK norms lifted or folded; else plain
    shape, attn_input = view.shape, (lambda h: view.attn_input(norm1(h)))
    stat = view_moment(module, src, view, h_cal, dev)
    mom, aw = stat.value, view.aw
    with torch.no_grad():  # the query refit's distance weights on the first calibration rows (also the loss scores')
        weights = None if s.refit_query == "off" else distance_weights(
            s.refit_query, aw, src, attn_input(h_cal.read(0, REFIT_ROWS).to(dev)), t.src_inv, t.kw["rope_src"], t.window)
    damping = rope_damping(weights, t.src_inv) if s.rope_score == "loss" else None
    rope_plan = mla.plan_rope(aw, mom, shape, s.rope_dim, s.rope_method, t.src_inv, s.rope_frequencies, t.target.inv_freq,
                              t.counts, t.stride, damping)
    split = mla.split_keys(aw, rope_plan, shape)
    metrics = mla.attention_metrics(aw, split, shape, mom) if s.objective == "attention" else None
    beta = mla.balance_factor(split, aw, mom, metrics)
    del split
    # each stage is built, measured and dropped in turn: at most one stage's weights are resident
    builders = {
        "exact": lambda: _exact_by_group(aw, shape, mom, t, dev),
        "rope": lambda: mla.attention_fn(mla.build_stage(aw, rope_plan, shape, mom, map_dtype=torch.float32, **t.kw), t.positions, dev, t.mask),
        "balance": lambda: mla.attention_fn(mla.build_stage(aw, rope_plan, shape, mom, beta=beta, metrics=metrics, map_dtype=torch.float32, **t.kw), t.positions, dev, t.mask),
    }
    source_attn = lambda x: module.self_attn(hidden_states=x, position_embeddings=t.src_pe, attention_mask=t.mask)[0]  # noqa: E731
    layer_errs, engine_info = {}, {}
    with torch.no_grad():
        ref = SourceAttention.of(source_attn, norm1, streams["source"], dev)
        for k in [k for k in t.built if k in streams or k not in builders]:  # in order; report-only stages if measured
            if k == "low-rank":
                low_p = mla.build_stage(aw, rope_plan, shape, mom, beta=beta, metrics=metrics, rank=s.data_rank,
                                        map_dtype=torch.float32, centred=not t.engine, **t.kw)
                attend, p32 = mla.attention_fn(low_p, t.positions, dev, t.mask)
                del low_p  # the native tensors are made from the fp32 copy (they are stored in <= fp32)
                if not t.engine and s.format != "attnkit":  # the constant channel's size: the largest latent norm
                    z_max = max(float((attn_input(b.to(dev)) @ p32.lat_w.T + p32.lat_b).norm(dim=-1).amax())
                                for _, b in h_cal.blocks(ROW_BATCH))
            elif k == "refit":
                attend, p32 = mla.attention_fn(refit_params(mla.on_device(p32, "cpu"), aw, rope_plan, src, mom, weights, t.src_inv),
                                               t.positions, dev, t.mask)
            elif k == "native":
                if s.format == "attnkit":
                    tensors = attnkit_tensors(mla.on_device(p32, "cpu"), src.shape, module.self_attn)
                elif t.engine:
                    tensors, engine_info = engine_tensors(mla.on_device(p32, "cpu"), shape, norm1, mom, h_cal, dev)
                else:
                    tensors = native_attention_tensors(mla.on_device(p32, "cpu"), shape, constant_for(z_max, s.out_dtype),
                                                       constant_for(stat.max_norm, s.out_dtype) if t.q_bias else None)
                del p32
                tensors = pad_value_heads(tensors, shape.H, shape.d, shape.d, s.v_head_dim)
                tensors = {n: v.to(s.out_dtype) for n, v in tensors.items()}  # what is written, and measured
                native = written_attention(t.target.config, layer, tensors, dev, s.format)
                attend = lambda x: native(x, position_embeddings=t.tgt_pe, attention_mask=t.mask)[0]  # noqa: E731
                if s.fit_steps:
                    fit = fit_attention(native, attend, source_attn, norm1, h_cal, s.fit_steps, s.fit_lr, dev, start=tensors)
                    engine_info = {**engine_info, "fit": fit.as_dict()}
                    fitted = native.state_dict()
                    tensors = {n: fitted[n].to(s.out_dtype) for n in tensors}
                    native = written_attention(t.target.config, layer, tensors, dev, s.format)  # as written
            else:
                attend = builders[k]()[0]
            attend = attend if k == "native" else view.wrap(attend)  # stages run on the view's input
            if k in streams:
                layer_errs[k] = measure_stage(attend, ref, norm1, streams[k], attn_err[k], dev, post1)
            del attend
        del native, aw, mom, stat, metrics, builders, weights
    # the calibration rows are not read after the last layer
    finish_layer(module, src, layer, dev, norms, source_attn, ref, streams, None if last_layer(src, layer) else h_cal)
    for name, v in {**{f"self_attn.{k}": v for k, v in tensors.items()}, **layer_tensors(module, fam, s.format)}.items():
        t.writer.add(f"model.layers.{layer}.{name}", v.to(s.out_dtype))
    return {"layer": layer, "beta": beta, "rope_components": {"virtual_head": rope_plan.kept_j.tolist(),
            "frequency_index": rope_plan.kept_i.tolist()}, "attn_rel_err_mean": layer_errs, **engine_info, **view.info}


def _exact_by_group(aw: mla.AttnWeights, shape: mla.Shape, mom: torch.Tensor, t: _Layers, dev: str):
    """The lossless rewrite (every key dim rotary, V as the latent), one KV group at a time.

    The attention output is the sum of the groups' outputs, so this is the same function as the
    whole-layer rewrite, without its dense H x (d + G d) x D query (G times the source's)."""
    fns = []
    for g in range(shape.G):
        aw_g, shape_g = mla.group_weights(aw, shape, g)
        rope_plan = mla.identity_plan(shape_g, t.src_inv)
        p = mla.build_stage(aw_g, rope_plan, shape_g, mom, dtype=torch.float32, **{
            **t.kw, "scale_tgt": (shape.d + rope_plan.d_r) ** -0.5, "rope_tgt": t.kw["rope_src"]})
        fns.append(mla.attention_fn(p, t.positions, dev, t.mask)[0])
    return (lambda x: sum(f(x) for f in fns)), None


def _at_layer(src: Source, s: Settings, t: _Layers, layer: int) -> _Layers:
    """`t` with `layer`'s own RoPE (inv_freq, scaling, tables) and sliding window for a family whose
    RoPE and windows follow config.layer_types (Gemma-3: local and global bases); `t` itself otherwise.
    The attnkit format rotates the shared key with the layer's own tables, so its target's are the same."""
    kind = layer_type(src, layer)
    if kind is None:
        return t
    inv, att, pe = t.by_type[kind]
    window = layer_window(src, layer)
    attnkit = s.format == "attnkit"
    kw = {**t.kw, "rope_src": att, **({"rope_tgt": att} if attnkit else {})}
    return replace(t, src_inv=inv, src_pe=pe, tgt_pe=pe if attnkit else t.tgt_pe, kw=kw, window=window,
                   mask=window_mask(s.seq_len, window, s.device))

