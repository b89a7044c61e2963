"""Every tensor a source checkpoint must hold, with the shape its config implies, checked from the
safetensors headers before any work.

Why: a config that disagrees with its weights (a `vocab_size` edited by hand, a head count copied
from another size, a layer dropped) otherwise converts with exit 0 into a checkpoint transformers
cannot load, or fails deep inside a conversion with a traceback. The names come from the family's
description (`attnkit.adapters.families`); the sizes from the config dict alone, so the check is a
pure function of (config, {name: shape}).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from attnkit.adapters.families import FAMILIES, Family
from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import INDEX_FILE, SINGLE_FILE, LazyCheckpoint

LAYERS = "model.layers."
_LAYER_INDEX = re.compile(rf"^{re.escape(LAYERS)}(\d+)\.")


@dataclass(frozen=True)
class Want:
    """What one tensor name must be: `shape` (None: must be absent), why (the config fields that say so)."""

    shape: tuple[int, ...] | None
    why: str
    required: bool = True


def _get(config: dict, field: str, default=None):
    value = config.get(field)
    return default if value is None else value


def _has_bias(config: dict, rule: bool | str) -> bool:
    return rule if isinstance(rule, bool) else bool(config.get(rule))


def _bias_why(rule: bool | str, config: dict) -> str:
    return "the family always has it" if rule is True else "the family has none" if rule is False else \
        f"{rule}={str(bool(config.get(rule))).lower()}"


def _linear(want: dict, name: str, out: int, inp: int, why: str, bias: bool, bias_why: str) -> None:
    want[f"{name}.weight"] = Want((out, inp), why)
    want[f"{name}.bias"] = Want((out,), why) if bias else Want(None, bias_why, required=False)


def _dims(config: dict) -> dict:
    D, H = int(config["hidden_size"]), int(config["num_attention_heads"])
    G = int(_get(config, "num_key_value_heads", H))
    d = config.get("head_dim")
    d_why = f"head_dim={d}" if d else f"head_dim=hidden_size/num_attention_heads={D // H}"
    return {"D": D, "H": H, "G": G, "d": int(d or D // H), "d_why": d_why}


def _plain_attention(want: dict, config: dict, family: Family, p: str) -> None:
    """q/k/v/o of a rotate-half family (separate or fused qkv)."""
    x = _dims(config)
    D, H, G, d = x["D"], x["H"], x["G"], x["d"]
    hidden = f"hidden_size={D}"
    q_why = f"num_attention_heads={H} x {x['d_why']}, {hidden}"
    kv_why = f"num_key_value_heads={G} x {x['d_why']}, {hidden}"
    qkv_bias, bias_why = _has_bias(config, family.qkv_bias), _bias_why(family.qkv_bias, config)
    if len(family.qkv) == 1:
        _linear(want, p + family.qkv[0], (H + 2 * G) * d, D,
                f"(num_attention_heads={H} + 2 x num_key_value_heads={G}) x {x['d_why']}, {hidden}", qkv_bias, bias_why)
    else:
        for name, out, why in zip(family.qkv, (H * d, G * d, G * d), (q_why, kv_why, kv_why)):
            _linear(want, p + name, out, D, why, qkv_bias, bias_why)
    _linear(want, p + family.o, D, H * d, f"{hidden}, num_attention_heads={H} x {x['d_why']}",
            _has_bias(config, family.o_bias), _bias_why(family.o_bias, config))


def _latent_attention(want: dict, config: dict, p: str) -> None:
    """DeepSeek-V3's MLA projections (transformers' DeepseekV3Attention)."""
    D, H = int(config["hidden_size"]), int(config["num_attention_heads"])
    r, d_r = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])
    nope, v = int(config["qk_nope_head_dim"]), int(config["v_head_dim"])
    q_lora = config.get("q_lora_rank")
    bias, bias_why = bool(config.get("attention_bias")), _bias_why("attention_bias", config)
    q_out = f"num_attention_heads={H} x (qk_nope_head_dim={nope} + qk_rope_head_dim={d_r})"
    if q_lora is None:
        _linear(want, p + "q_proj", H * (nope + d_r), D, f"{q_out}, hidden_size={D}", False, "the family has none")
    else:
        _linear(want, p + "q_a_proj", int(q_lora), D, f"q_lora_rank={q_lora}, hidden_size={D}", bias, bias_why)
        want[p + "q_a_layernorm.weight"] = Want((int(q_lora),), f"q_lora_rank={q_lora}")
        _linear(want, p + "q_b_proj", H * (nope + d_r), int(q_lora), f"{q_out}, q_lora_rank={q_lora}", False,
                "the family has none")
    _linear(want, p + "kv_a_proj_with_mqa", r + d_r, D, f"kv_lora_rank={r} + qk_rope_head_dim={d_r}, hidden_size={D}",
            bias, bias_why)
    want[p + "kv_a_layernorm.weight"] = Want((r,), f"kv_lora_rank={r}")
    _linear(want, p + "kv_b_proj", H * (nope + v), r,
            f"num_attention_heads={H} x (qk_nope_head_dim={nope} + v_head_dim={v}), kv_lora_rank={r}", False,
            "the family has none")
    _linear(want, p + "o_proj", D, H * v, f"hidden_size={D}, num_attention_heads={H} x v_head_dim={v}", bias, bias_why)


def _dense_mlp(config: dict, family: Family, layer: int) -> bool:
    """DeepSeek-V3 layers from `first_k_dense_replace` on are MoE (not described here); others are dense."""
    if family.attention != "latent":
        return True
    return layer < int(_get(config, "first_k_dense_replace", 3))


def _mlp(want: dict, config: dict, family: Family, p: str) -> None:
    D, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    bias, bias_why = _has_bias(config, family.mlp_bias), _bias_why(family.mlp_bias, config)
    up_why = f"intermediate_size={inter}, hidden_size={D}"
    if len(family.gate_up) == 1:
        _linear(want, p + family.gate_up[0], 2 * inter, D, f"2 x {up_why}", bias, bias_why)
    else:
        for name in family.gate_up:
            _linear(want, p + name, inter, D, up_why, bias, bias_why)
    _linear(want, p + family.down, D, inter, f"hidden_size={D}, intermediate_size={inter}", bias, bias_why)


def expected(config: dict, family: Family) -> dict[str, Want]:
    """name -> Want for every tensor the family's description names, sized from `config`."""
    D, V, L = int(config["hidden_size"]), int(config["vocab_size"]), int(config["num_hidden_layers"])
    want: dict[str, Want] = {f"{family.embed}.weight": Want((V, D), f"vocab_size={V}, hidden_size={D}"),
                             f"{family.final_norm}.weight": Want((D,), f"hidden_size={D}")}
    tied = config.get("tie_word_embeddings")
    head_why = f"vocab_size={V}, hidden_size={D}" + ("" if tied is None else f"; tie_word_embeddings={str(tied).lower()}")
    want[f"{family.lm_head}.weight"] = Want((V, D), head_why, required=tied is False)
    for i in range(L):
        p = f"{LAYERS}{i}."
        for norm in (n for n in (*family.norms, *family.post_norms) if n is not None):
            want[f"{p}{norm}.weight"] = Want((D,), f"hidden_size={D}")
        if family.attention == "latent":
            _latent_attention(want, config, p + "self_attn.")
        else:
            _plain_attention(want, config, family, p + "self_attn.")
        if _dense_mlp(config, family, i):
            _mlp(want, config, family, p + "mlp.")
    return want


def _fmt(shape) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _layer_problem(config: dict, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """Layers the checkpoint holds against num_hidden_layers (missing or extra layers)."""
    L = int(config["num_hidden_layers"])
    present = sorted({int(m.group(1)) for m in map(_LAYER_INDEX.match, shapes) if m})
    extra = [i for i in present if i >= L]
    if extra:
        name = next(n for n in sorted(shapes) if n.startswith(f"{LAYERS}{extra[0]}."))
        return f"{name} is a tensor of layer {extra[0]}, but config num_hidden_layers={L} implies {_span(0, L - 1)}"
    missing = [i for i in range(L) if i not in present]
    if missing:
        held = f"{len(present)} layers ({_span(present[0], present[-1])})" if present else "no layers"
        return f"layer {missing[0]} is missing ({LAYERS}{missing[0]}.*): the checkpoint holds {held}, config num_hidden_layers={L}"
    return None


def _span(first: int, last: int) -> str:
    return f"layer {first} only" if first == last else f"layers {first}-{last}"


def shape_problem(config: dict, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The first disagreement between a checkpoint's tensors and its config, as one line; None if none.

    Only families with a description are checked (others are refused by name elsewhere); a config
    missing the fields the shapes come from is itself the problem."""
    family = _family(config)
    if family is None:
        return None
    try:
        want = expected(config, family)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        return f"config.json cannot size the {config.get('model_type')} tensors (field {exc} missing or invalid)"
    layers = _layer_problem(config, shapes)
    if layers:
        return layers
    for name, w in want.items():
        shape = shapes.get(name)
        if shape is None:
            if w.shape is not None and w.required:
                return f"{name} is missing; config.json implies {_fmt(w.shape)} ({w.why})"
        elif w.shape is None:
            return f"{name} {_fmt(shape)} is present, but config.json says there is none ({w.why})"
        elif tuple(shape) != w.shape:
            return f"{name} has shape {_fmt(shape)}, config.json implies {_fmt(w.shape)} ({w.why})"
    return None


def check_shapes(config: dict, shapes: dict[str, tuple[int, ...]], where: Path | str | None = None) -> None:
    """Raise AttnkitError (one line) when a tensor's shape disagrees with the config (`shape_problem`)."""
    problem = shape_problem(config, shapes)
    if problem:
        raise AttnkitError(f"{where}: {problem}" if where else problem)


def _family(config: dict) -> Family | None:
    """The source family of a config; a DEX/DIFF output (`attnkit_<family>`) keeps its source's tensors."""
    return FAMILIES.get(str(config.get("model_type")).removeprefix("attnkit_"))


def with_defaults(config: dict) -> dict:
    """The config as transformers reads it: fields a config.json leaves out take the family's config
    class defaults (derived ones such as head_dim included), so the shapes are the ones it builds."""
    family = _family(config)
    if family is None:
        return config
    try:
        full = family.config_class().from_dict(dict(config)).to_dict()
    except Exception:  # noqa: BLE001 - a config transformers rejects is refused when it is loaded
        return config
    return {**config, **full}


def check_weights(path: Path, config: dict, required: bool = True, where: str | None = None) -> LazyCheckpoint | None:
    """Open a model folder's safetensors weights and check their shapes against `config` (headers
    only, nothing loaded); errors start with `where` (default: the folder). `required=False` (eval,
    bench): a folder without safetensors is let through to transformers, which loads other formats."""
    path = Path(path)
    if not required and not ((path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()):
        return None
    try:
        ckpt = LazyCheckpoint(path)
        shapes = ckpt.shapes()
    except AttnkitError as exc:
        if where is None:
            raise
        raise AttnkitError(f"{where}: {exc}") from None
    check_shapes(with_defaults(config), shapes, where or path)
    return ckpt
