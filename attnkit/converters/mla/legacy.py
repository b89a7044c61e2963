"""What transformers 4.x needs to read a DeepSeek-V3 checkpoint written by transformers 5 the same
way (measured with benchmarks/compat_transformers.py, docs/compat.md): `rope_theta` at the top
level and `rope_scaling` (4.x ignores `rope_parameters`), and a tokenizer class it knows."""

from __future__ import annotations

import math

LEGACY_TOKENIZER_CLASS = "PreTrainedTokenizerFast"

# Oldest transformers that builds the same model as 5.x from a config carrying legacy_fields(), by
# RoPE type (keys), measured in docs/compat.md. DeepSeek-V3 first ships in 4.51.0; `q_lora_rank:
# null` (a plain q_proj, what attnkit writes) is built from 4.53.0 on: 4.51 and 4.52 always build
# q_a_proj / q_b_proj and fail on None.
MIN_TRANSFORMERS = {
    "default": "4.51.0",
    "longrope": "4.51.0",
    "yarn": "4.51.0",
    "llama3": "4.51.0",
    "linear": "4.51.0",
}
MIN_TRANSFORMERS_NO_Q_LORA = "4.53.0"
# yarn whose `factor` differs from max_position_embeddings / original_max_position_embeddings, or with
# `truncate: false`: 4.51-4.55 compute other frequencies (measured 0.145 relative on 4.53 and 4.55)
MIN_TRANSFORMERS_YARN_FACTOR = "4.56.0"


def rope_parameters_of(config: dict) -> dict:
    """The flat RoPE dict a transformers 5 DeepSeek-V3 config carries (`rope_parameters`)."""
    rp = config.get("rope_parameters")
    if rp is None:  # a 4.x-style config: rope_scaling (+ rope_theta at top level)
        rp = dict(config.get("rope_scaling") or {})
        rp.setdefault("rope_type", rp.get("type", "default"))
        rp.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return dict(rp)


def legacy_fields(config: dict) -> dict:
    """Keys to add to (or change in) a transformers-5 DeepSeek-V3 config.json so that transformers 4.x
    builds the same model. Pure: returns only the keys to write, `config` is not changed.

    transformers 4.x reads `rope_theta` at the top level and the RoPE type and its parameters from
    `rope_scaling` (it ignores `rope_parameters`); its attention reads `rope_scaling["factor"]`
    whenever `rope_scaling` is not null, so a non-default type always carries `factor`. transformers
    5 takes `rope_scaling`, when present and not null, *instead of* `rope_parameters` (and fills in
    `rope_theta` from the top level), so `rope_scaling` is a full copy and null for the default ladder.
    `torch_dtype` mirrors `dtype` (renamed in 4.56) for `from_pretrained(torch_dtype="auto")`.
    """
    rp = rope_parameters_of(config)
    rope_type = rp.get("rope_type", "default")
    out: dict = {"rope_theta": float(rp.get("rope_theta", 10000.0))}
    if rope_type == "default":
        out["rope_scaling"] = None
    else:
        # rope_theta stays at the top level only (4.x warns about it inside rope_scaling; 5.x fills it in)
        scaling = {k: v for k, v in rp.items() if k not in ("type", "rope_theta")}
        scaling["rope_type"] = rope_type
        scaling.setdefault("factor", 1.0)
        if rope_type == "longrope":
            # 4.x derives the longrope attention factor from `factor` and a top-level
            # original_max_position_embeddings; written explicitly it is used as is in both.
            scaling.setdefault("attention_factor", 1.0)
        out["rope_scaling"] = scaling
    if "dtype" in config and "torch_dtype" not in config:
        out["torch_dtype"] = config["dtype"]
    return out


def legacy_tokenizer_fields(tokenizer_config: dict) -> dict:
    """Keys to change in tokenizer_config.json so that transformers 4.x loads the tokenizer."""
    cls = tokenizer_config.get("tokenizer_class")
    if cls in (None, "TokenizersBackend"):
        return {"tokenizer_class": LEGACY_TOKENIZER_CLASS}
    return {}


def min_transformers(config: dict) -> str:
    """Oldest transformers release that loads this DeepSeek-V3 config (with legacy_fields) correctly."""
    rp = rope_parameters_of(config)
    rope_type = rp.get("rope_type", "default")
    need = [MIN_TRANSFORMERS.get(rope_type, "5.0.0")]
    if config.get("q_lora_rank") is None:
        need.append(MIN_TRANSFORMERS_NO_Q_LORA)
    if rope_type == "yarn":
        # before 4.56, yarn replaces `factor` by max_position_embeddings / original_max_position_embeddings
        # (when the latter is given) and always truncates the correction range
        orig = rp.get("original_max_position_embeddings")
        implied = config.get("max_position_embeddings", 0) / orig if orig else rp.get("factor")
        if rp.get("truncate", True) is False or (orig and not math.isclose(rp.get("factor", implied), implied)):
            need.append(MIN_TRANSFORMERS_YARN_FACTOR)
    return max(need, key=version_key)


def version_key(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in v.split(".")[:3])
