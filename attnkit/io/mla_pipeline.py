"""`attnkit convert --to mla`: the streaming driver around `attnkit.converters.mla`.

Layer by layer: read the source layer's attention, accumulate the input moment on calibration
hidden states, build every stage of the conversion and run the held-out text through each
stage's attention (to measure its error); then drop the stages, load the layer's MLP, finish the
layer for every stream and write the DeepSeek-V3 tensors. Only one layer's weights are ever
resident, and the hidden states (calibration and held-out) wait in scratch files (`RowStore`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from attnkit.converters import mla
from attnkit.converters.architectures import Family, describe
from attnkit.converters.mla_metrics import ErrorStat, logits_metrics, relative_errors
from attnkit.converters.mla_native import constant_for, deepseek_config, native_attention_tensors
from attnkit.converters.rope import exact_rope_parameters, geometric_rope_parameters, source_rope, target_rope
from attnkit.errors import AttnkitError
from attnkit.io.calib import Moment, calibration_tokens, embed_into, read_rows, tensor_rows
from attnkit.io.rowstore import RowStore
from attnkit.io.checkpoint import LazyCheckpoint, ShardedWriter, atomic_output_dir, check_output_dir
from attnkit.io.mla_report import build_report, format_report
from attnkit.io.mla_settings import Settings, resolve_settings
from attnkit.io.stream_copy import merge_index, stream_tensors
from attnkit.io.resolve import check_causal_lm, resolve_model

STAGES = ("exact", "rope", "balance", "low-rank", "native")
REFIT_STAGES = ("exact", "rope", "balance", "low-rank", "refit", "native")  # with --refit-query
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
              "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
ROW_BATCH = 1


@dataclass
class Source:
    path: Path
    config: dict
    hf_config: object
    family: Family
    ckpt: LazyCheckpoint
    shape: mla.Shape
    prefix: str  # "model.layers."


def _return_freed_memory(trim: bool = False) -> None:
    """Large tensors freed by one layer go back to the OS (glibc otherwise keeps them in its heap);
    `trim` also hands back the free pages inside the heap (what tokenising the calibration text
    and a layer's small tensors leave behind)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB
        if trim:
            libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def convert(args: argparse.Namespace) -> int:
    started = time.time()
    _return_freed_memory()
    path = resolve_model(args.model)
    config = check_causal_lm(path)
    family = describe(config)
    ckpt = LazyCheckpoint(path)
    check_output_dir(args.out, args.force)
    hf_config = AutoConfig.from_pretrained(path)
    hf_config._attn_implementation = "sdpa"
    D, H = hf_config.hidden_size, hf_config.num_attention_heads
    G = getattr(hf_config, "num_key_value_heads", None) or H
    d = getattr(hf_config, "head_dim", None) or D // H
    src = Source(path, config, hf_config, family, ckpt, mla.Shape(D, H, G, d), "model.layers.")
    s = resolve_settings(args, src.shape, ckpt, config)
    if s.device == "cuda" and not torch.cuda.is_available():
        raise AttnkitError("--device cuda was requested but no CUDA device is available")
    _check_disk(ckpt, s, Path(args.out))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise AttnkitError(f"cannot load the tokenizer of {path}: {str(exc).splitlines()[0]}") from None
    calib, held_out, held_note = calibration_tokens(tokenizer, s.calib, s.seq_len, s.calib_tokens, s.eval_tokens, s.seed)
    scores = None
    if s.kv_budget is not None:  # measured choice of (kv_lora_rank, rope_dim); sets them in s
        from attnkit.io.mla_budget import choose_split
        parent = Path(args.out).absolute().parent  # scratch on the disk the output goes to
        budget, scores = choose_split(src, s, calib, tokenizer, held_out.shape[0], parent if parent.is_dir() else None)
    _return_freed_memory(trim=True)
    with atomic_output_dir(args.out, args.force) as tmp:
        report = _convert_into(tmp, src, s, calib, held_out, scores)
        report["source"]["model"] = args.model
        if s.kv_budget is not None:
            report["kv_budget"] = budget
        report["calibration"].update(held_out_from=held_note, calib_rows=int(calib.shape[0]), held_out_rows=int(held_out.shape[0]))
        report["wall_time_s"] = round(time.time() - started, 2)
        for name in COPY_FILES:
            if (path / name).is_file():
                shutil.copy2(path / name, tmp / name)
        (tmp / "attnkit_report.json").write_text(json.dumps(report, indent=2))
        _write_card(tmp)
    print(format_report(report))
    print(f"wrote {args.out}")
    return 0


def _check_disk(ckpt: LazyCheckpoint, s: Settings, out: Path) -> None:
    src_bytes = ckpt.total_bytes()
    estimate = int(src_bytes * s.out_dtype.itemsize / max(1, s.src_itemsize) * 1.1) + (1 << 20)
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if free < estimate:
        raise AttnkitError(f"not enough disk space in {parent}: need about {estimate / 1e9:.2f} GB, {free / 1e9:.2f} GB free")


def _write_card(folder: Path) -> None:
    try:
        from attnkit.io.model_card import write_model_card
    except ModuleNotFoundError:  # the publish module ships separately
        return
    write_model_card(folder)


def _source_layer(src: Source, layer: int, device: str, mlp: bool = True) -> torch.nn.Module:
    """The source decoder layer (transformers' own class) with its weights, fp32 on `device`;
    without `mlp` its MLP stays on the meta device until `_load_mlp`."""
    prefix = f"{src.prefix}{layer}."
    names = [n for n in src.ckpt.keys() if n.startswith(prefix) and (mlp or ".mlp." not in n)]
    # MLP weights stay in the source dtype (upcast per call): they are most of a layer's bytes
    state = {n[len(prefix):]: src.ckpt.get(n, dtype=None if ".mlp." in n else torch.float32, device=device) for n in names}
    with torch.device("meta"):
        module = src.family.decoder_layer_class()(src.hf_config, layer)
    try:
        missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
        if unexpected or any(mlp or not n.startswith("mlp.") for n in missing):
            raise RuntimeError(f"missing {missing}, unexpected {unexpected}")
    except RuntimeError as exc:
        raise AttnkitError(f"layer {layer} of {src.path} does not match its config: {str(exc).splitlines()[0]}") from None
    if mlp:
        _upcast_mlp(module)
    return module.eval()


def _load_mlp(module: torch.nn.Module, src: Source, layer: int, device: str) -> None:
    prefix = f"{src.prefix}{layer}.mlp."
    state = {n[len(prefix):]: src.ckpt.get(n, device=device) for n in src.ckpt.keys() if n.startswith(prefix)}
    try:
        module.mlp.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise AttnkitError(f"layer {layer} of {src.path} does not match its config: {str(exc).splitlines()[0]}") from None
    _upcast_mlp(module)


def _upcast_mlp(module: torch.nn.Module) -> None:
    for name, child in list(module.mlp.named_children()):
        if isinstance(child, torch.nn.Linear) and child.weight.dtype != torch.float32:
            setattr(module.mlp, name, _Fp32Linear(child))


class _Fp32Linear(torch.nn.Module):
    """A Linear whose weight stays in its (16-bit) storage dtype and is upcast to fp32 per call,
    a block of output rows at a time (an 8192 x 2048 weight would otherwise need 64 MB more)."""

    BLOCK = 1 << 21  # weight elements upcast at once (8 MB in fp32)

    def __init__(self, lin: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = max(1, self.BLOCK // self.weight.shape[1])
        out = torch.cat([x @ self.weight[lo : lo + rows].float().T for lo in range(0, self.weight.shape[0], rows)], dim=-1)
        return out if self.bias is None else out + self.bias.float()


def attn_weights(module: torch.nn.Module, family: Family, shape: mla.Shape) -> mla.AttnWeights:
    """q/k/v/o weights and biases of a source attention module (fused qkv split)."""
    attn = module.self_attn
    if len(family.qkv) == 1:
        fused = getattr(attn, family.qkv[0])
        sizes = [shape.H * shape.d, shape.G * shape.d, shape.G * shape.d]
        ws = fused.weight.split(sizes)
        bs = fused.bias.split(sizes) if fused.bias is not None else (None, None, None)
    else:
        lin = [getattr(attn, n) for n in family.qkv]
        ws, bs = [x.weight for x in lin], [x.bias for x in lin]
    o = getattr(attn, family.o)
    return mla.AttnWeights(ws[0].detach(), ws[1].detach(), ws[2].detach(), o.weight.detach(),
                           *(None if b is None else b.detach() for b in bs), None if o.bias is None else o.bias.detach())


def mlp_tensors(module: torch.nn.Module, family: Family) -> dict[str, torch.Tensor]:
    mlp = module.mlp
    if len(family.gate_up) == 1:
        gate, up = getattr(mlp, family.gate_up[0]).weight.detach().chunk(2)
    else:
        gate, up = (getattr(mlp, n).weight.detach() for n in family.gate_up)
    return {"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up, "mlp.down_proj.weight": getattr(mlp, family.down).weight.detach(),
            "input_layernorm.weight": getattr(module, family.norms[0]).weight.detach(),
            "post_attention_layernorm.weight": getattr(module, family.norms[1]).weight.detach()}


def _run_stage_layer(module, family, attend, h):
    """One decoder layer of the source with its attention replaced by `attend` (pre-norm residual)."""
    norm1, norm2 = getattr(module, family.norms[0]), getattr(module, family.norms[1])
    h = h + attend(norm1(h))
    return h + module.mlp(norm2(h))


def rope_scores(src: Source, s: Settings, calib: torch.Tensor, scratch: Path) -> list[torch.Tensor]:
    """Pre-pass (exact frequencies): every layer's RoPE component scores (`mla.slot_counts` turns
    them into slots per frequency for a rope_dim).

    Scores only rank components, so a quarter of the calibration rows (at least 4) is enough."""
    h = _embedded(src, calib[: max(4, calib.shape[0] // 4)], scratch / "rope-prepass.f32")
    src_pe = source_pe(src, calib.shape[1], s.device)
    scores = []
    for layer in tqdm(range(src.config["num_hidden_layers"]), desc="rope scores", unit="layer"):
        module = _source_layer(src, layer, s.device)
        mom = _moment(module, src.family, h, src.shape, s.device).value
        scores.append(mla.rope_scores(_cpu_weights(module, src), mom, src.shape, s.rope_method)[1])
        h.map_(_through(module, src_pe), ROW_BATCH, s.device)
        del module
    h.close()
    return scores


def rope_tables(rotary: torch.nn.Module, length: int, width: int, device: str) -> tuple:
    """(cos, sin) of a transformers rotary-embedding module for positions 0..length-1."""
    probe = torch.zeros(1, length, width, device=device)  # [1, T, D]: only its dtype/device are read
    return rotary.to(device)(probe, torch.arange(length, device=device)[None])


def source_pe(src: Source, length: int, device: str) -> tuple:
    """The source's own (cos, sin) tables for positions 0..length-1."""
    return rope_tables(src.family.rotary_class()(src.hf_config), length, src.shape.D, device)


def _through(module, pe):
    """fn(block [b, T, D]) -> the source decoder layer's output on it (positions' RoPE tables `pe`)."""
    return lambda b: _as_tensor(module(b, attention_mask=None, position_embeddings=pe))


def _embedded(src: Source, ids: torch.Tensor, path: Path) -> RowStore:
    store = RowStore(path, ids.shape[0], (ids.shape[1], src.shape.D))
    embed_into(store, src.ckpt, src.family.embed + ".weight", ids)
    return store


def _moment(module, family: Family, h: RowStore, shape: mla.Shape, device: str) -> Moment:
    """E[x~ x~^T] of the attention input (after the layer's first norm) over hidden states h."""
    moment = Moment(shape.D, device)
    norm1 = getattr(module, family.norms[0])
    with torch.no_grad():
        for _, b in h.blocks(ROW_BATCH):
            moment.add(norm1(b.to(device)))
    return moment


def _cpu_weights(module, src: Source) -> mla.AttnWeights:
    aw = attn_weights(module, src.family, src.shape)
    return mla.AttnWeights(*(None if t is None else t.detach().cpu() for t in
                             (aw.wq, aw.wk, aw.wv, aw.wo, aw.bq, aw.bk, aw.bv, aw.bo)))


@dataclass
class _Targets:
    """What every layer's conversion shares: the target config, positions, RoPE tables, writer."""

    tgt_cfg: object
    positions: torch.Tensor
    src_pe: tuple
    tgt_pe: tuple
    src_inv: torch.Tensor
    tgt_inv: torch.Tensor
    counts: torch.Tensor | None
    kw: dict  # scales and RoPE attention factors of build_stage
    q_bias: bool
    writer: ShardedWriter


def _convert_into(tmp: Path, src: Source, s: Settings, calib: torch.Tensor, held_out: torch.Tensor,
                  scores: list[torch.Tensor] | None = None) -> dict:
    """Convert into `tmp`; `scores`: the RoPE pre-pass when already run (by --kv-budget's choice)."""
    scratch = tmp / ".scratch"
    scratch.mkdir()
    try:
        return _convert_streams(tmp, scratch, src, s, calib, held_out, scores)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _convert_streams(tmp: Path, scratch: Path, src: Source, s: Settings, calib: torch.Tensor, held_out: torch.Tensor,
                     scores: list[torch.Tensor] | None) -> dict:
    shape, dev, fam = src.shape, s.device, src.family
    src_inv, src_att = source_rope(fam, src.hf_config)
    src_rope = dict(src.hf_config.rope_parameters or {})
    theta = float(src_rope.get("rope_theta", 10000.0))
    positions = torch.arange(s.seq_len, device=dev)
    src_pe = source_pe(src, s.seq_len, dev)
    q_bias = _has_q_bias(src)
    counts = None
    if s.rope_frequencies == "exact":
        scores = scores if scores is not None else rope_scores(src, s, calib, scratch)
        counts = mla.slot_counts(scores, s.rope_dim)
        slot_inv = src_inv[torch.arange(shape.d // 2).repeat_interleave(counts)]
        rope_params = exact_rope_parameters(slot_inv, theta, int(src.config.get("max_position_embeddings", 4096)), src_att)
    else:
        rope_params = geometric_rope_parameters(src_rope)
    tgt_cfg = deepseek_config(src.config, shape, s.rope_dim, s.kv_lora_rank, shape.D + 1 if q_bias else None,
                              rope_params, s.dtype_name)
    tgt_cfg._attn_implementation = "sdpa"
    tgt_inv, tgt_att = target_rope(tgt_cfg)
    if s.rope_frequencies == "exact" and not torch.allclose(tgt_inv, slot_inv, rtol=1e-5):
        raise AttnkitError("internal: the exported RoPE frequencies differ from the kept ones")  # guarded by tests
    tgt_pe = rope_tables(DeepseekV3RotaryEmbedding(tgt_cfg), s.seq_len, shape.D, dev)
    with torch.device("meta"):
        scale_tgt = DeepseekV3Attention(tgt_cfg, 0).scaling
    t = _Targets(tgt_cfg, positions, src_pe, tgt_pe, src_inv, tgt_inv, counts,
                 dict(scale_src=_source_scale(src), scale_tgt=scale_tgt, rope_src=src_att, rope_tgt=tgt_att),
                 q_bias, ShardedWriter(tmp, max_shard_bytes=s.max_shard_bytes))
    h_cal = _embedded(src, calib, scratch / "calib.f32")
    h0 = _embedded(src, held_out, scratch / "source.f32")
    stages = STAGES if s.refit_query == "off" else REFIT_STAGES
    streams = {"source": h0, **{k: h0.copy(scratch / f"{k}.f32") for k in stages}}
    attn_err = {k: ErrorStat() for k in stages}
    per_layer = []
    for layer in tqdm(range(src.config["num_hidden_layers"]), desc="convert --to mla", unit="layer"):
        per_layer.append(_convert_layer(src, s, t, layer, h_cal, streams, attn_err))
        _return_freed_memory(trim=True)
    h_cal.close()
    embed_name = fam.embed + ".weight"
    final_norm = src.ckpt.get(fam.final_norm + ".weight", dtype=torch.float32, device=dev)
    t.writer.add("model.norm.weight", final_norm.to(s.out_dtype))
    tied = bool(src.config.get("tie_word_embeddings", False))
    head_name = embed_name if tied or fam.lm_head + ".weight" not in src.ckpt else fam.lm_head + ".weight"
    t.writer.close()
    big = [("model.embed_tokens.weight", embed_name)] + ([] if tied else [("lm_head.weight", head_name)])
    merge_index(tmp, "model-embeddings.safetensors", stream_tensors(src.ckpt, big, tmp / "model-embeddings.safetensors", s.out_dtype))
    tgt_cfg.to_json_file(str(tmp / "config.json"))
    finals = {k: _final_hidden(src, store.all().to(dev), final_norm) for k, store in streams.items()}
    for store in streams.values():
        store.close()
    targets = held_out[:, 1:].reshape(-1).to(dev)
    src_ppl, metrics = logits_metrics(finals["source"], {k: finals[k] for k in stages}, targets,
                                      lambda: _head_chunks(src.ckpt, head_name, dev))
    return build_report(src, s, tgt_cfg, metrics, attn_err, src_ppl, per_layer)


def _convert_layer(src: Source, s: Settings, t: _Targets, layer: int, h_cal: RowStore,
                   streams: dict[str, RowStore], attn_err: dict[str, ErrorStat]) -> dict:
    """Convert, measure and write one layer; advances `h_cal` and every stream through it.

    Two phases, so that the stages and the MLP are never resident together: (1) attention only —
    moment, stages, their errors, every stream's attention residual; (2) the MLP. A function of
    its own so that everything the layer allocated is freed when it returns."""
    shape, dev, fam = src.shape, s.device, src.family
    module = _source_layer(src, layer, dev, mlp=False)
    norm1, norm2 = getattr(module, fam.norms[0]), getattr(module, fam.norms[1])
    moment = _moment(module, fam, h_cal, shape, dev)
    mom, aw = moment.value, _cpu_weights(module, src)
    plan = mla.plan_rope(aw, mom, shape, s.rope_dim, s.rope_method, t.src_inv, s.rope_frequencies, t.tgt_inv, t.counts)
    split = mla.split_keys(aw, plan, shape)
    metrics = mla.attention_metrics(aw, split, shape, mom) if s.objective == "attention" else None
    beta = mla.balance_factor(split, aw, mom, metrics)
    del split
    # each stage is built, measured and dropped in turn: at most one stage's weights are resident
    builders = {
        "exact": lambda: _exact_by_group(aw, shape, mom, t, dev),
        "rope": lambda: _mla_fn(mla.build_stage(aw, plan, shape, mom, map_dtype=torch.float32, **t.kw), t.positions, dev),
        "balance": lambda: _mla_fn(mla.build_stage(aw, plan, shape, mom, beta=beta, metrics=metrics, map_dtype=torch.float32, **t.kw), t.positions, dev),
    }
    source_attn = lambda x: module.self_attn(hidden_states=x, position_embeddings=t.src_pe, attention_mask=None)[0]  # noqa: E731
    layer_errs = {}
    with torch.no_grad():
        for k in [k for k in REFIT_STAGES if k in streams]:  # the stages this run measures, in order
            if k == "low-rank":
                low_p = mla.build_stage(aw, plan, shape, mom, beta=beta, metrics=metrics, rank=s.kv_lora_rank - 1, map_dtype=torch.float32, **t.kw)
                attend, p32 = _mla_fn(low_p, t.positions, dev)
                del low_p  # the native tensors are made from the fp32 copy (they are stored in <= fp32)
                z_max = max(float((norm1(b.to(dev)) @ p32.lat_w.T + p32.lat_b).norm(dim=-1).amax())
                            for _, b in h_cal.blocks(ROW_BATCH))
            elif k == "refit":
                from attnkit.io.mla_budget import REFIT_ROWS, refit_stage
                x = norm1(h_cal.read(0, REFIT_ROWS).to(dev))
                attend, p32 = _mla_fn(refit_stage(_on(p32, "cpu"), aw, plan, src, s, mom, x), t.positions, dev)
            elif k == "native":
                tensors = native_attention_tensors(_on(p32, "cpu"), shape, constant_for(z_max, s.out_dtype),
                                                   constant_for(moment.max_norm, s.out_dtype) if t.q_bias else None)
                del p32
                tensors = {n: v.to(s.out_dtype) for n, v in tensors.items()}  # what is written, and measured
                with torch.device("meta"):
                    native = DeepseekV3Attention(t.tgt_cfg, layer)
                native.load_state_dict({n: v.float().to(dev) for n, v in tensors.items()}, strict=True, assign=True)
                attend = lambda x: native(x, position_embeddings=t.tgt_pe, attention_mask=None)[0]  # noqa: E731
            else:
                attend = builders[k]()[0]
            layer_errs[k] = _measure_stage(attend, source_attn, norm1, streams["source"], streams[k], attn_err[k], dev)
            del attend
        del native, aw, mom, moment, metrics, builders
        for store in (streams["source"], h_cal):
            store.map_(lambda h: h + source_attn(norm1(h)), ROW_BATCH, dev)
        _load_mlp(module, src, layer, dev)
        for store in (*streams.values(), h_cal):
            store.map_(lambda h: h + module.mlp(norm2(h)), ROW_BATCH, dev)
    for name, v in {**{f"self_attn.{k}": v for k, v in tensors.items()}, **mlp_tensors(module, fam)}.items():
        t.writer.add(f"model.layers.{layer}.{name}", v.to(s.out_dtype))
    return {"layer": layer, "beta": beta, "rope_components": {"virtual_head": plan.kept_j.tolist(),
            "frequency_index": plan.kept_i.tolist()}, "attn_rel_err_mean": layer_errs}


def _measure_stage(attend, source_attn, norm1, source: RowStore, stream: RowStore, stat: ErrorStat, dev: str) -> float:
    """A stage's attention error on the source's inputs; its own stream gets its attention residual
    (the MLP half of the layer follows for every stream together)."""
    errs = []
    for lo, h in stream.blocks(ROW_BATCH):
        x_src = norm1(source.read(lo, lo + ROW_BATCH).to(dev))
        errs.append(relative_errors(attend(x_src), source_attn(x_src)))
        h = h.to(dev)
        stream.write(lo, h + attend(norm1(h)))
    e = torch.cat(errs)
    stat.add(e)
    return float(e.mean())


def _exact_by_group(aw: mla.AttnWeights, shape: mla.Shape, mom: torch.Tensor, t: _Targets, dev: str):
    """The lossless rewrite (every key dim rotary, V as the latent), one KV group at a time.

    The attention output is the sum of the groups' outputs, so this is the same function as the
    whole-layer rewrite, without its dense H x (d + G d) x D query (G times the source's)."""
    fns = []
    for g in range(shape.G):
        aw_g, shape_g = mla.group_weights(aw, shape, g)
        plan = mla.identity_plan(shape_g, t.src_inv)
        p = mla.build_stage(aw_g, plan, shape_g, mom, dtype=torch.float32, **{
            **t.kw, "scale_tgt": (shape.d + plan.d_r) ** -0.5, "rope_tgt": t.kw["rope_src"]})
        fns.append(_mla_fn(p, t.positions, dev)[0])
    return (lambda x: sum(f(x) for f in fns)), None


def _as_tensor(out):
    return out[0] if isinstance(out, tuple) else out


def _mla_fn(p: mla.MLAParams, positions: torch.Tensor, dev: str):
    """(attention function, its fp32 parameters on `dev`)."""
    p32 = _on(mla.to_dtype(p, torch.float32), dev)
    return (lambda x: mla.mla_attention(p32, x, positions)), p32


def _on(p: mla.MLAParams, dev: str) -> mla.MLAParams:
    return mla.MLAParams(**{k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in p.__dict__.items()})


def _final_hidden(src: Source, h: torch.Tensor, norm_w: torch.Tensor) -> torch.Tensor:
    """Final RMSNorm of every position but the last (those predict the next held-out token)."""
    eps = float(src.config.get("rms_norm_eps", 1e-6))
    x = h[:, :-1].float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (norm_w * x).reshape(-1, x.shape[-1])


def _head_chunks(ckpt: LazyCheckpoint, name: str, dev: str, chunk: int = 8192):
    path = ckpt.folder / ckpt.weight_map[name]
    for lo in range(0, tensor_rows(ckpt, name), chunk):
        yield lo, read_rows(path, name, lo, lo + chunk).to(dev)


def _has_q_bias(src: Source) -> bool:
    fused = len(src.family.qkv) == 1
    name = f"{src.prefix}0.self_attn.{src.family.qkv[0]}.bias"
    return name in src.ckpt if fused else f"{src.prefix}0.self_attn.q_proj.bias" in src.ckpt


def _source_scale(src: Source) -> float:
    return float(getattr(src.hf_config, "query_pre_attn_scalar", None) or src.shape.d) ** -0.5


