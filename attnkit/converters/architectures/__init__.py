"""Declarative descriptions of the source families the MLA converter understands.

One `Family` entry says where each weight of a decoder layer lives and which transformers
classes run a source layer (used for calibration). Everything else is refused with the
reason the DeepSeek-V3 format cannot express it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from attnkit.errors import AttnkitError


@dataclass(frozen=True)
class Family:
    model_type: str
    prefix: str  # transformers class-name prefix, e.g. "Llama" -> LlamaDecoderLayer
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # one entry = fused [q; k; v]
    o: str = "o_proj"
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # one entry = fused [gate; up]
    down: str = "down_proj"
    norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"

    def module(self):
        return importlib.import_module(f"transformers.models.{self.model_type}.modeling_{self.model_type}")

    def decoder_layer_class(self):
        return getattr(self.module(), f"{self.prefix}DecoderLayer")

    def rotary_class(self):
        return getattr(self.module(), f"{self.prefix}RotaryEmbedding")


FAMILIES = {
    "llama": Family("llama", "Llama"),
    "mistral": Family("mistral", "Mistral"),
    "qwen2": Family("qwen2", "Qwen2"),
    "phi3": Family("phi3", "Phi3", qkv=("qkv_proj",), gate_up=("gate_up_proj",)),
}

REFUSED = {
    "gemma2": "Gemma-2 has sandwich norms (post-attention/post-feedforward RMSNorm), attention-logit softcapping "
    "and final-logit softcapping, which a DeepSeek-V3 checkpoint cannot express",
    "gemma3": "Gemma-3 has QK-norm and sandwich norms, which a DeepSeek-V3 checkpoint cannot express",
    "qwen3": "Qwen3 applies a per-head RMSNorm to keys (QK-norm) before RoPE; MLA keys are linear in the "
    "normalised latent, so the per-head key norm cannot be expressed",
    "olmo2": "OLMo-2 applies RMSNorm to the full query/key projections (QK-norm) and normalises after the "
    "sublayers, which a DeepSeek-V3 checkpoint cannot express",
    "deepseek_v2": "the model already uses MLA",
    "deepseek_v3": "the model already uses MLA",
}

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def describe(config: dict) -> Family:
    """Return the family of a source config dict, or raise AttnkitError naming why not."""
    model_type = config.get("model_type")
    if model_type in REFUSED:
        raise AttnkitError(f"cannot convert {model_type} to MLA: {REFUSED[model_type]}")
    if model_type not in FAMILIES:
        raise AttnkitError(
            f"cannot convert model_type {model_type!r} to MLA: supported are {', '.join(sorted(FAMILIES))}"
        )
    if config.get("mlp_bias"):
        raise AttnkitError("cannot convert: the MLP has biases (mlp_bias), DeepSeek-V3's MLP has none")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "longrope" and rope.get("long_factor") == rope.get("short_factor"):
        pass
    elif rope_type not in STATIC_ROPE_TYPES:
        raise AttnkitError(
            f"cannot convert: RoPE type {rope_type!r} changes with sequence length; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True) and window < config.get("max_position_embeddings", 0):
        raise AttnkitError(
            f"cannot convert: the model attends through a sliding window of {window} tokens, which DeepSeek-V3 "
            "cannot express (the output would attend to every earlier token); to accept that, convert a copy "
            "whose config.json has sliding_window: null"
        )
    if float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise AttnkitError("cannot convert: partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    return FAMILIES[model_type]
