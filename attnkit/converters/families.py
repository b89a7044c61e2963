"""Which source checkpoints `convert --to mla` accepts: the family's description
(`attnkit.adapters.families`) plus the config-level checks it cannot express (RoPE type, sliding
window, MLP bias, partial rotary), each refused with its reason."""

from __future__ import annotations

from attnkit.adapters.families import FAMILIES, Family
from attnkit.errors import AttnkitError

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def describe(config: dict) -> Family:
    """Return the family of a source config dict, or raise AttnkitError naming why not."""
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)
    if family is not None and family.mla_refusal:
        raise AttnkitError(f"cannot convert {model_type} to MLA: {family.mla_refusal}")
    if family is None:
        supported = sorted(n for n, f in FAMILIES.items() if not f.mla_refusal)
        raise AttnkitError(f"cannot convert model_type {model_type!r} to MLA: supported are {', '.join(supported)}")
    if config.get("mlp_bias"):
        raise AttnkitError("cannot convert: the MLP has biases (mlp_bias), DeepSeek-V3's MLP has none")
    for field, why in family.mla_unsupported:
        if config.get(field):
            raise AttnkitError(f"cannot convert {model_type} to MLA: {field} is set: {why}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    # a family with RoPE per layer type (Gemma-3) keeps one parameter set per type
    for params in (rope.values() if family.by_layer_type and "full_attention" in rope else (rope,)):
        _check_rope(params or {})
    window = config.get("sliding_window")
    # a family with layer types keeps its sliding-window layers as windows (the attnkit format; its
    # deepseek_v3 format is refused by the family's native_refusal)
    if (not family.by_layer_type and window and config.get("use_sliding_window", True)
            and window < config.get("max_position_embeddings", 0)):
        raise AttnkitError(
            f"cannot convert: the model attends through a sliding window of {window} tokens, which DeepSeek-V3 "
            "cannot express (the output would attend to every earlier token); to accept that, convert a copy "
            "whose config.json has sliding_window: null"
        )
    if float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise AttnkitError("cannot convert: partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    return family


def _check_rope(rope: dict) -> None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "longrope" and rope.get("long_factor") == rope.get("short_factor"):
        return
    if rope_type not in STATIC_ROPE_TYPES:
        raise AttnkitError(
            f"cannot convert: RoPE type {rope_type!r} changes with sequence length; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
