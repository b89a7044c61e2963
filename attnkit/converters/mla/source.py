"""The source model, streamed one decoder layer at a time (what the MLA converter reads).

`open_source` resolves and checks a MODEL spec once; `load_layer` builds one source decoder layer
(transformers' own class) with its weights; hidden states wait in scratch files (`RowStore`) and
are pushed through a layer with `through`. `Moment` and `moment` give the second moment of a
layer's attention input, which is all the factorisations need from calibration text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from attnkit.adapters.families import Family
from attnkit.converters.families import describe
from attnkit.converters.mla.layer import AttnWeights, Shape
from attnkit.converters.mla.qknorm import FOLD_ROWS, LayerView, folded_view, lifted_view
from attnkit.converters.mla.rope import source_rope
from attnkit.converters.shapes import check_weights
from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import LazyCheckpoint
from attnkit.io.resolve import check_causal_lm, load_config, resolve_model
from attnkit.converters.stream.rowstore import RowStore
from attnkit.io.tensor_rows import embed_into, read_rows, tensor_rows

ROW_BATCH = 1  # rows of hidden states pushed through a layer at once


@dataclass
class Source:
    path: Path
    config: dict
    hf_config: object
    family: Family
    ckpt: LazyCheckpoint
    shape: Shape
    prefix: str  # "model.layers."
    dtype: torch.dtype  # the weights' storage dtype (bf16 / fp16, else fp32): the output's by default
    embed_scale: float | None  # what the embedding lookup is multiplied by (Gemma's sqrt(hidden_size)), None: 1
    nbytes: int  # of its weight files (the output's size follows from it)
    mlp_dtype: torch.dtype = torch.float32  # what the MLP multiplies in (`mlp_compute_dtype`)

    @property
    def calib_note(self) -> dict:
        """The report's record of the arithmetic behind the calibration and held-out rows."""
        return {"mlp_dtype": str(self.mlp_dtype).removeprefix("torch.")}



def open_source(model: str, check=describe, calib_dtype: str = "fp32", device: str = "cpu") -> Source:
    """Resolve MODEL, refuse what the target cannot express (`check`: MLA's `describe` by default),
    read its config; no weights are loaded. `calib_dtype` (`--calib-dtype`): what its MLP multiplies in."""
    path = resolve_model(model)
    family = check(load_config(path))  # the family's own refusal first: it names the reason (multimodal Gemma-3)
    config = check_causal_lm(path)
    ckpt = check_weights(path, config)  # every tensor's shape against the config, from the headers
    hf_config = AutoConfig.from_pretrained(path)
    hf_config._attn_implementation = "sdpa"
    D, H = hf_config.hidden_size, hf_config.num_attention_heads
    G = getattr(hf_config, "num_key_value_heads", None) or H
    d = getattr(hf_config, "head_dim", None) or D // H
    # Gemma scales the lookup by sqrt(hidden_size), rounded to the embedding's dtype as it does
    scale = float(torch.tensor(D**0.5).to(ckpt.storage_dtype(family.embed + ".weight"))) if family.embed_scale else None
    dtype = ckpt.storage_dtype()
    mlp_dtype = mlp_compute_dtype(dtype, device) if calib_dtype == "auto" else torch.float32
    return Source(path, config, hf_config, family, ckpt, Shape(D, H, G, d), "model.layers.", dtype, scale,
                  ckpt.total_bytes(), mlp_dtype)


def mlp_compute_dtype(storage: torch.dtype, device: str) -> torch.dtype:
    """The MLP's arithmetic under `--calib-dtype auto`: a 16-bit checkpoint's own dtype where `device`
    multiplies it natively (AMX or AVX512-BF16 CPUs, CUDA), else fp32. Why: the MLP is most of a layer's
    arithmetic and only carries the rows to the next layer; on a 2-core AMX CPU a 1B-wide MLP takes
    0.5-1.2 s per 8,192 tokens in bf16 against 3.9 s upcast to fp32, and the rows differ from fp32's by
    the 16-bit rounding the model has when it is served."""
    if storage not in (torch.bfloat16, torch.float16):
        return torch.float32
    if device.startswith("cuda"):
        return storage if storage == torch.float16 or torch.cuda.is_bf16_supported() else torch.float32
    native = {torch.bfloat16: ("_is_amx_tile_supported", "_is_avx512_bf16_supported"),
              torch.float16: ("_is_amx_fp16_supported",)}[storage]
    return storage if any(getattr(torch.cpu, name, lambda: False)() for name in native) else torch.float32


def load_layer(src: Source, layer: int, device: str, mlp: bool = True) -> torch.nn.Module:
    """The source decoder layer (transformers' own class) with its weights, fp32 on `device`;
    without `mlp` its MLP stays on the meta device until `load_mlp`. MLP weights stay in the source
    dtype (they are most of a layer's bytes) and multiply in `src.mlp_dtype` (`_StoredLinear`): upcast
    per call under fp32, which computes exactly what the whole model loaded in fp32 computes."""
    prefix = f"{src.prefix}{layer}."
    names = [n for n in src.ckpt.keys() if n.startswith(prefix) and (mlp or ".mlp." not in n)]
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
        _upcast_mlp(module, src.mlp_dtype)
    return module.eval()


def load_mlp(module: torch.nn.Module, src: Source, layer: int, device: str) -> None:
    prefix = f"{src.prefix}{layer}.mlp."
    state = {n[len(prefix):]: src.ckpt.get(n, device=device) for n in src.ckpt.keys() if n.startswith(prefix)}
    try:
        module.mlp.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise AttnkitError(f"layer {layer} of {src.path} does not match its config: {str(exc).splitlines()[0]}") from None
    _upcast_mlp(module, src.mlp_dtype)


def _upcast_mlp(module: torch.nn.Module, compute: torch.dtype) -> None:
    for name, child in list(module.mlp.named_children()):
        if isinstance(child, torch.nn.Linear) and child.weight.dtype != torch.float32:
            setattr(module.mlp, name, _StoredLinear(child, compute))


class _StoredLinear(torch.nn.Module):
    """A Linear whose weight stays in its (16-bit) storage dtype; fp32 in, fp32 out. `compute` fp32:
    the weight is upcast per call, a block of output rows at a time (an 8192 x 2048 weight would
    otherwise need 64 MB more); the storage dtype: the input is rounded to it and multiplied natively."""

    BLOCK = 1 << 21  # weight elements upcast at once (8 MB in fp32)

    def __init__(self, lin: torch.nn.Linear, compute: torch.dtype):
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias
        self.native = compute == lin.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias).float()
        rows = max(1, self.BLOCK // self.weight.shape[1])
        out = torch.cat([x @ self.weight[lo : lo + rows].float().T for lo in range(0, self.weight.shape[0], rows)], dim=-1)
        return out if self.bias is None else out + self.bias.float()


def attn_weights(module: torch.nn.Module, family: Family, shape: Shape) -> AttnWeights:
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
    return AttnWeights(ws[0].detach(), ws[1].detach(), ws[2].detach(), o.weight.detach(),
                           *(None if b is None else b.detach() for b in bs), None if o.bias is None else o.bias.detach())


def cpu_weights(module, src: Source) -> AttnWeights:
    aw = attn_weights(module, src.family, src.shape)
    return AttnWeights(*(None if t is None else t.detach().cpu() for t in
                             (aw.wq, aw.wk, aw.wv, aw.wo, aw.bq, aw.bk, aw.bv, aw.bo)))


def layer_tensors(module: torch.nn.Module, family: Family, fmt: str) -> dict[str, torch.Tensor]:
    """A layer's tensors besides its attention, as the output names them: the source's own names in
    the attnkit format (the source's decoder layer runs it), DeepSeek-V3's otherwise."""
    if fmt == "attnkit":
        return {n: v.detach() for n, v in module.state_dict().items() if not n.startswith("self_attn.")}
    return mlp_tensors(module, family)


def mlp_tensors(module: torch.nn.Module, family: Family) -> dict[str, torch.Tensor]:
    mlp = module.mlp
    if len(family.gate_up) == 1:
        gate, up = getattr(mlp, family.gate_up[0]).weight.detach().chunk(2)
    else:
        gate, up = (getattr(mlp, n).weight.detach() for n in family.gate_up)
    return {"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up, "mlp.down_proj.weight": getattr(mlp, family.down).weight.detach(),
            "input_layernorm.weight": getattr(module, family.norms[0]).weight.detach(),
            "post_attention_layernorm.weight": getattr(module, family.norms[1]).weight.detach()}


def run_stage_layer(module, family, attend, h):
    """One decoder layer of the source with its attention replaced by `attend`, which takes the
    attention's normed input: h + post1(attend(norm1(h))), then h + post2(mlp(norm2(h))) (`layer_norms`)."""
    norm1, post1, norm2, post2 = layer_norms(module, family)
    h = h + post1(attend(norm1(h)))
    return h + post2(module.mlp(norm2(h)))


def embedded(src: Source, ids: torch.Tensor, path: Path) -> RowStore:
    """The input embeddings of ids [rows, T] as a stream: a RowStore [rows, T, D] at `path`."""
    store = RowStore(path, ids.shape[0], (ids.shape[1], src.shape.D))
    embed_into(store, src.ckpt, src.family.embed + ".weight", ids, scale=src.embed_scale)
    return store


class Moment:
    """Running E[x~ x~^T] of x~ = [x; 1] over all tokens seen (fp64)."""

    def __init__(self, dim: int, device="cpu"):
        self.sum = torch.zeros(dim + 1, dim + 1, dtype=torch.float64, device=device)
        self.max_norm = 0.0
        self.normalised = False

    def add(self, x: torch.Tensor) -> None:
        if self.normalised:
            raise RuntimeError("Moment.add after .value")
        flat = x.reshape(-1, x.shape[-1]).double()
        aug = torch.cat([flat, torch.ones(flat.shape[0], 1, dtype=flat.dtype, device=flat.device)], dim=1)
        self.sum += aug.T @ aug
        self.max_norm = max(self.max_norm, float(flat.norm(dim=-1).max()))

    @property
    def value(self) -> torch.Tensor:
        """The moment (normalised in place on first use: the running sum is not kept twice)."""
        if not self.normalised:
            self.sum /= self.sum[-1, -1].clone()
            self.normalised = True
        return self.sum.cpu()


def layer_norms(module, family: Family) -> tuple:
    """(attention input, attention output, MLP input, MLP output) norms of a decoder layer, identity
    where the family has none: h + post1(attn(norm1(h))), then h + post2(mlp(norm2(h)))."""
    pick = lambda name: torch.nn.Identity() if name is None else getattr(module, name)  # noqa: E731
    return (pick(family.norms[0]), pick(family.post_norms[0]), pick(family.norms[1]), pick(family.post_norms[1]))


def moment(module, family: Family, h: RowStore, shape: Shape, device: str) -> Moment:
    """E[x~ x~^T] of the attention input (after the layer's first norm) over hidden states h."""
    return input_moment(layer_norms(module, family)[0], h, shape.D, device)


def input_moment(attn_input, h: RowStore, dim: int, device: str) -> Moment:
    """E[x~ x~^T] of attn_input(block) [.., dim] over hidden states h."""
    stat = Moment(dim, device)
    with torch.no_grad():
        for _, b in h.blocks(ROW_BATCH):
            stat.add(attn_input(b.to(device)))
    return stat


def layer_view(src: Source, fmt: str, module, h: RowStore, pe: tuple, device: str) -> LayerView:
    """What the MLA math sees of a layer (`qknorm.LayerView`): the plain attention input for a family
    without QK norms; for one with, the norms lifted into the input (`fmt` attnkit, exact) or folded
    into W_q / W_k with constants fitted on the first rows of h (deepseek_v3, lossy)."""
    aw, qk = cpu_weights(module, src), src.family.qk_norm
    if qk is None:
        return LayerView(lambda x: x, aw, src.shape, {})
    if fmt == "attnkit":
        return lifted_view(module.self_attn, aw, src.shape, qk)
    with torch.no_grad():
        x = layer_norms(module, src.family)[0](h.read(0, FOLD_ROWS).to(device))
    return folded_view(module.self_attn, aw, src.shape, qk, x, pe)


def view_moment(module, src: Source, view: LayerView, h: RowStore, device: str) -> Moment:
    """E[x~ x~^T] of the math's input (the view's) over hidden states h."""
    norm1 = layer_norms(module, src.family)[0]
    return input_moment(lambda b: view.attn_input(norm1(b)), h, view.shape.D, device)


def rope_tables(rotary: torch.nn.Module, length: int, width: int, device: str, layer_type: str | None = None) -> tuple:
    """(cos, sin) of a transformers rotary-embedding module for positions 0..length-1 (of one layer
    type for a rotary module that takes it, Gemma-3's)."""
    probe = torch.zeros(1, length, width, device=device)  # [1, T, D]: only its dtype/device are read
    extra = () if layer_type is None else (layer_type,)
    return rotary.to(device)(probe, torch.arange(length, device=device)[None], *extra)


def source_pe(src: Source, length: int, device: str, layer: int | None = None) -> tuple:
    """The source's own (cos, sin) tables for positions 0..length-1 (those of `layer`'s type when the
    family has RoPE per layer type; `layer` is then needed)."""
    return rope_tables(src.family.rotary_class()(src.hf_config), length, src.shape.D, device, layer_type(src, layer))


def layer_type(src: Source, layer: int | None) -> str | None:
    """config.layer_types[layer] for a family whose RoPE and window are per layer type (Gemma-3), else None."""
    if not src.family.by_layer_type:
        return None
    if layer is None:
        raise ValueError(f"{src.family.model_type} has RoPE per layer type: name the layer")
    return src.hf_config.layer_types[layer]


def layer_rope(src: Source, layer: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) of the source's RoPE at `layer` (one set for most families)."""
    return source_rope(src.family, src.hf_config, layer_type(src, layer))


def layer_window(src: Source, layer: int) -> int | None:
    """The sliding window of `layer` (a query at t sees keys s with t - s < window, as transformers'
    sliding masks), None for full attention; only families with layer types keep windows."""
    if layer_type(src, layer) != "sliding_attention":
        return None
    return int(src.hf_config.sliding_window)


def window_mask(length: int, window: int | None, device) -> torch.Tensor | None:
    """Boolean [1, 1, T, T] mask (True = attend) of causal attention within `window`; None (plain
    causal) without a window or when the window covers the whole length."""
    if window is None or window >= length:
        return None
    pos = torch.arange(length, device=device)
    delta = pos[:, None] - pos[None, :]
    return ((delta >= 0) & (delta < window))[None, None]


def through(module, pe, mask: torch.Tensor | None = None):
    """fn(block [b, T, D]) -> the source decoder layer's output on it (positions' RoPE tables `pe`;
    `mask`: a sliding window's, None = causal)."""
    return lambda b: _as_tensor(module(b, attention_mask=mask, position_embeddings=pe))


def _as_tensor(out):
    return out[0] if isinstance(out, tuple) else out


def final_hidden(src: Source, h: torch.Tensor, norm_w: torch.Tensor) -> torch.Tensor:
    """Final RMSNorm of every position but the last (those predict the next held-out token)."""
    eps = float(src.config.get("rms_norm_eps", 1e-6))
    x = h[:, :-1].float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return ((norm_w + src.family.norm_offset) * x).reshape(-1, x.shape[-1])  # Gemma's norm scales by 1 + w


def final_softcap(src: Source) -> float | None:
    """The final-logit softcapping the source's head applies (Gemma's config field), None for none."""
    field = src.family.final_softcap
    return (src.config.get(field) or None) if field else None


def lm_head_name(src: Source) -> str:
    """The LM head's tensor: the embedding's when the model ties them or has no separate head."""
    fam = src.family
    tied = bool(src.config.get("tie_word_embeddings", False))
    return fam.embed + ".weight" if tied or fam.lm_head + ".weight" not in src.ckpt else fam.lm_head + ".weight"


def head_chunks(ckpt: LazyCheckpoint, name: str, dev: str, chunk: int = 8192):
    path = ckpt.folder / ckpt.weight_map[name]
    for lo in range(0, tensor_rows(ckpt, name), chunk):
        yield lo, read_rows(path, name, lo, lo + chunk).to(dev)


def has_q_bias(src: Source) -> bool:
    fused = len(src.family.qkv) == 1
    name = f"{src.prefix}0.self_attn.{src.family.qkv[0]}.bias"
    return name in src.ckpt if fused else f"{src.prefix}0.self_attn.q_proj.bias" in src.ckpt


def source_scale(src: Source) -> float:
    return float(getattr(src.hf_config, "query_pre_attn_scalar", None) or src.shape.d) ** -0.5
