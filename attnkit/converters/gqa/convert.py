"""`attnkit convert --to gqa`: fewer KV heads, written in the source's own architecture.

Streams the source layer by layer with the MLA converter's machinery (`mla.source`: lazy reader,
one decoder layer at a time, hidden states in scratch files; `mla.metrics`: attention error and the
logits comparison): per layer the second moment of the attention input on calibration rows gives
every statistic the alignment and merge need (`gqa.math`); each stage's attention runs on the
held-out rows (its error), the merged layer is written through `ShardedWriter`, everything else of
the layer is copied. Only one layer's weights are resident.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from attnkit.adapters.families import FAMILIES, Family
from attnkit.converters.common import (StreamSettings, calibration_tokens, check_device,
                                       stream_fields)
from attnkit.converters.gqa import math as gm
from attnkit.converters.gqa.report import build_report, format_report
from attnkit.converters.measure import SourceAttention, measure_stage, measure_streams, return_freed_memory
from attnkit.converters.mla.convert import COPY_FILES
from attnkit.converters.mla.layer import AttnWeights
from attnkit.converters.mla.metrics import ErrorStat
from attnkit.converters.mla.source import (ROW_BATCH, Source, cpu_weights, embedded, layer_norms, lm_head_name, moment,
                                           open_source, source_pe)
from attnkit.converters.stream.engine import finish_layer, last_layer, stream_layers
from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import ShardedWriter, atomic_output_dir, check_output_dir
from attnkit.card.build import write_model_card
from attnkit.converters.stream.rowstore import RowStore
from attnkit.converters.stream.outside import write_outside_layers

SUPPORTED = ("llama", "mistral", "qwen2", "phi3")
STAGES = {"aligned": ("align", "merge", "refit"), "mean": ("merge",)}
KEY_SCALE = False  # per-pair key scale in the alignment: exact too, but measured worse (docs/gqa-vs-mla.md)
REFIT_RIDGE = 1e-6  # of the mean diagonal of the o_proj refit's normal matrix


@dataclass(kw_only=True)
class Settings(StreamSettings):
    kv_heads: int
    merge: str


def describe(config: dict) -> Family:
    """The family of a source config, or one line saying why `--to gqa` does not take it."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise AttnkitError(f"cannot convert model_type {model_type!r} to GQA: supported are {', '.join(sorted(SUPPORTED))}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise AttnkitError("cannot convert to GQA: partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    return FAMILIES[model_type]


def resolve_settings(args: argparse.Namespace, src: Source) -> Settings:
    n, G = args.kv_heads, src.shape.G
    if n is None:
        raise AttnkitError("--to gqa needs --kv-heads N (the KV heads per layer of the output)")
    if n < 1 or n > G:
        raise AttnkitError(f"--kv-heads must be in 1..{G} (the source's KV heads), got {n}")
    if G % n:
        raise AttnkitError(f"--kv-heads {n} does not divide the source's {G} KV heads into equal groups")
    if src.shape.d % 2:
        raise AttnkitError(f"head_dim {src.shape.d} is odd: rotate-half RoPE needs an even head dim")
    run = stream_fields(args, src.dtype)
    cfg = src.config
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True) and window < args.calib_seq_len:
        raise AttnkitError(
            f"the model attends through a sliding window of {window} tokens, shorter than --calib-seq-len "
            f"{args.calib_seq_len}: the report would measure attention beyond the window; give --calib-seq-len <= {window} "
            "(the output keeps the window)")
    return Settings(kv_heads=n, merge=args.merge, **run)


def convert(args: argparse.Namespace) -> int:
    started = time.time()
    return_freed_memory()
    src = open_source(args.model, describe, args.calib_dtype, args.device)
    check_output_dir(args.out, args.force, (src.path,))
    s = resolve_settings(args, src)
    check_device(s.device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.path)
    except Exception as exc:
        raise AttnkitError(f"cannot load the tokenizer of {src.path}: {str(exc).splitlines()[0]}") from None
    with atomic_output_dir(args.out, args.force, (src.path,)) as tmp:
        calib, held_out, held_note = calibration_tokens(tokenizer, s.calib, s.seq_len, s.calib_tokens, s.eval_tokens, s.seed)
        scratch = tmp / ".scratch"
        scratch.mkdir()
        try:
            report = execute(src, s, calib, held_out, tmp, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        report["source"]["model"] = args.model
        report["calibration"].update(**src.calib_note, held_out_from=held_note, calib_rows=int(calib.shape[0]), held_out_rows=int(held_out.shape[0]))
        report["wall_time_s"] = round(time.time() - started, 2)
        config = json.loads((src.path / "config.json").read_text())
        config["num_key_value_heads"] = s.kv_heads
        if args.dtype:
            config["torch_dtype" if "torch_dtype" in config else "dtype"] = s.dtype_name
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in COPY_FILES:
            if (src.path / name).is_file():
                shutil.copy2(src.path / name, tmp / name)
        (tmp / "attnkit_report.json").write_text(json.dumps(report, indent=2))
        write_model_card(tmp)
    print(format_report(report))
    print(f"wrote {args.out}")
    return 0


def _attention_names(fam: Family, layer: int) -> set[str]:
    pre = f"model.layers.{layer}.self_attn."
    return {pre + f"{n}.{p}" for n in (*fam.qkv, fam.o) for p in ("weight", "bias")}


def attention_tensors(aw: AttnWeights, fam: Family) -> dict[str, torch.Tensor]:
    """Attention weights under the family's own names (Phi-3: fused qkv_proj)."""
    if len(fam.qkv) == 1:
        out = {f"{fam.qkv[0]}.weight": torch.cat([aw.wq, aw.wk, aw.wv])}
        if aw.bq is not None:
            out[f"{fam.qkv[0]}.bias"] = torch.cat([aw.bq, aw.bk, aw.bv])
    else:
        out = {f"{n}.weight": w for n, w in zip(fam.qkv, (aw.wq, aw.wk, aw.wv))}
        out.update({f"{n}.bias": b for n, b in zip(fam.qkv, (aw.bq, aw.bk, aw.bv)) if b is not None})
    out[f"{fam.o}.weight"] = aw.wo
    if aw.bo is not None:
        out[f"{fam.o}.bias"] = aw.bo
    return out


def attention_module(src: Source, aw: AttnWeights, kv_heads: int, layer: int, dev: str):
    """The family's own attention class with `kv_heads` KV heads and the weights `aw` (fp32)."""
    cfg = copy.deepcopy(src.hf_config)
    cfg.num_key_value_heads = kv_heads
    with torch.device("meta"):
        attn = src.family.attention_class()(cfg, layer)
    state = {k: v.float().to(dev) for k, v in attention_tensors(aw, src.family).items()}
    attn.load_state_dict(state, strict=True, assign=True)
    return attn.eval()


def execute(src: Source, s: Settings, calib: torch.Tensor, held_out: torch.Tensor, tmp: Path, scratch: Path) -> dict:
    dev, fam = s.device, src.family
    pe = source_pe(src, s.seq_len, dev)
    writer = ShardedWriter(tmp, max_shard_bytes=s.max_shard_bytes)
    h_cal = embedded(src, calib, scratch / "calib.f32")
    h0 = embedded(src, held_out, scratch / "source.f32")
    stages = STAGES[s.merge] if s.kv_heads < src.shape.G else ()
    streams = {"source": h0, **{k: h0.copy(scratch / f"{k}.f32") for k in stages}}
    attn_err = {k: ErrorStat() for k in stages}
    per_layer = stream_layers(src, dev, lambda layer, module: _convert_layer(src, s, layer, module, pe, h_cal, streams,
                                                                             attn_err, writer),
                              f"{src.path.name}: convert --to gqa", mlp="deferred")
    h_cal.close()
    layer_names = {n for n in src.ckpt.keys() if n.startswith(src.prefix)}
    write_outside_layers(src, tmp, writer, s.out_dtype, {n: n for n in src.ckpt.keys() if n not in layer_names},
                         stream_above=0)
    final_norm = src.ckpt.get(fam.final_norm + ".weight", dtype=torch.float32, device=dev)
    src_ppl, metrics = measure_streams(src, streams, stages, held_out, final_norm, lm_head_name(src), dev)
    return build_report(src, s, metrics, attn_err, src_ppl, per_layer)


def _convert_layer(src: Source, s: Settings, layer: int, module: torch.nn.Module, pe, h_cal: RowStore,
                   streams: dict[str, RowStore], attn_err: dict[str, ErrorStat], writer: ShardedWriter) -> dict:
    """The streaming engine's hook: merge, measure and write one layer (`module`, its MLP not yet
    read); advances `h_cal` and every stream through it (`finish_layer`, as the MLA converter does)."""
    shape, dev, fam = src.shape, s.device, src.family
    norms = layer_norms(module, fam)  # h + post1(attn(norm1(h))), h + post2(mlp(norm2(h)))
    norm1, post1 = norms[:2]
    aw = cpu_weights(module, src)
    identity = s.kv_heads == shape.G
    info: dict = {"layer": layer}
    with torch.no_grad():
        if identity:  # nothing to merge: the source's tensors, bit for bit
            stages = {}
        else:
            # the moment ([D+1, D+1] fp64, 34 MB at a 1B width) is freed on return, before the refit and the MLP
            stages, info_math = gm.convert_layer(aw, shape, s.kv_heads, s.merge, moment(module, fam, h_cal, shape, dev).value,
                                                 scale=KEY_SCALE)
            info.update(info_math)
        source_attn = lambda x: module.self_attn(hidden_states=x, position_embeddings=pe, attention_mask=None)[0]  # noqa: E731
        if "refit" in STAGES[s.merge] and stages:
            stages["refit"] = refit_output(src, stages["merge"], s.kv_heads, layer, pe, source_attn, norm1, h_cal, dev)
        if stages:  # the last stage is what is written: measured as stored (output dtype)
            final = list(stages)[-1]
            stages[final] = AttnWeights(*(None if t is None else t.to(s.out_dtype).float() for t in asdict_weights(stages[final])))
        errs, ref = {}, None
        if stages:
            ref = SourceAttention.of(source_attn, norm1, streams["source"], dev)
            for k, weights in stages.items():
                attn = attention_module(src, weights, shape.G if k == "align" else s.kv_heads, layer, dev)
                attend = lambda x, a=attn: a(hidden_states=x, position_embeddings=pe, attention_mask=None)[0]  # noqa: E731
                errs[k] = measure_stage(attend, ref, norm1, streams[k], attn_err[k], dev, post1)
                del attn
            stages = {final: stages[final]}  # only what is written outlives the measurement (not beside the MLP)
    # the calibration rows are read only by a later layer's merge
    finish_layer(module, src, layer, dev, norms, source_attn, ref, streams,
                 None if last_layer(src, layer) or identity else h_cal)
    attn_names = _attention_names(fam, layer)
    prefix = f"{src.prefix}{layer}."
    if identity:
        written = {}
    else:
        written = {f"{prefix}self_attn.{k}": v.to(s.out_dtype) for k, v in attention_tensors(stages[final], fam).items()}
    for name in sorted(n for n in src.ckpt.keys() if n.startswith(prefix)):
        if name in written:
            continue
        if name in attn_names and not identity:
            continue  # replaced (a source bias the merge does not write cannot occur: biases are kept)
        writer.add(name, src.ckpt.get(name).to(s.out_dtype))
    for name, v in written.items():
        writer.add(name, v)
    return {**info, "attn_rel_err_mean": errs}


def refit_output(src: Source, aw: AttnWeights, kv_heads: int, layer: int, pe, source_attn, norm1, h_cal: RowStore,
                 dev: str) -> AttnWeights:
    """o_proj refit by least squares on the calibration rows: the merged layer's per-head outputs z
    (o_proj's input) mapped onto the source attention's output y, O = E[y z^T] (E[z z^T] + ridge)^{-1}.
    Every head's projection sees every other head's merge error, so it compensates across heads."""
    attn = attention_module(src, aw, kv_heads, layer, dev)
    width = aw.wo.shape[1]
    zz = torch.zeros(width, width, dtype=torch.float64, device=dev)
    yz = torch.zeros(aw.wo.shape[0], width, dtype=torch.float64, device=dev)
    seen = {}
    hook = getattr(attn, src.family.o).register_forward_pre_hook(lambda _m, inp: seen.__setitem__("z", inp[0]))
    try:
        for _, b in h_cal.blocks(ROW_BATCH):
            x = norm1(b.to(dev))
            y = source_attn(x)
            if aw.bo is not None:
                y = y - aw.bo.to(dev)
            attn(hidden_states=x, position_embeddings=pe, attention_mask=None)
            z = seen.pop("z").reshape(-1, width).double()
            zz += z.T @ z
            yz += y.reshape(-1, y.shape[-1]).double().T @ z
    finally:
        hook.remove()
    zz += REFIT_RIDGE * zz.diagonal().mean().clamp_min(1e-30) * torch.eye(width, dtype=zz.dtype, device=dev)
    wo = torch.linalg.solve(zz, yz.T).T  # yz zz^{-1} (zz symmetric)
    return AttnWeights(aw.wq, aw.wk, aw.wv, wo.float().cpu(), aw.bq, aw.bk, aw.bv, aw.bo)


def asdict_weights(aw: AttnWeights) -> tuple:
    return (aw.wq, aw.wk, aw.wv, aw.wo, aw.bq, aw.bk, aw.bv, aw.bo)
