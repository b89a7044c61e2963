"""One description per source family: where each weight of a decoder layer lives, how its
attention runs, and what the MLA converter refuses about it (and why).

Read by the converters (tensor names, refusals) and by the runtime modules of converted models
(`modeling_attnkit`). It sits beside the modeling code because that code travels inside converted
checkpoints (`auto_map`): `modeling_attnkit` imports it relatively, transformers copies it along,
and so it imports only the standard library — never attnkit, never torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str
    prefix: str  # transformers class-name prefix, e.g. "Llama" -> LlamaDecoderLayer, LlamaForCausalLM
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # one entry = fused [q; k; v]
    o: str = "o_proj"
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # one entry = fused [gate; up]
    down: str = "down_proj"
    norms: tuple[str | None, str | None] = ("input_layernorm", "post_attention_layernorm")  # attention / MLP inputs
    post_norms: tuple[str | None, str | None] = (None, None)  # attention / MLP outputs (OLMo-2's post-norm blocks)
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    # which linear layers carry a bias: True (always), False (never), or the config field that says
    qkv_bias: bool | str = "attention_bias"
    o_bias: bool | str = "attention_bias"
    mlp_bias: bool | str = "mlp_bias"
    # how the attention turns hidden states into per-head q, k, v at run time:
    # "rotate_half" = separate q/k/v projections + the family's rotate-half RoPE (Llama-like);
    # "latent" = DeepSeek's MLA (latent + shared RoPE key); None = no runtime retrofit (fused qkv)
    attention: str | None = "rotate_half"
    sliding_window: str | None = None  # "config" (config.sliding_window) | "module" (attn.sliding_window)
    mla_refusal: str | None = None  # why `convert --to mla` refuses the family; None = converted
    # QK-norm: the source normalises queries and keys before RoPE, "head" = per head (Qwen3, Gemma-3),
    # "all" = over all heads at once (OLMo-2); such families convert to the exact `attnkit` MLA format
    qk_norm: str | None = None
    native_refusal: str | None = None  # why `--format deepseek_v3` cannot express the rest of the model

    def module(self):
        return importlib.import_module(f"transformers.models.{self.model_type}.modeling_{self.model_type}")

    def decoder_layer_class(self):
        return getattr(self.module(), f"{self.prefix}DecoderLayer")

    def rotary_class(self):
        return getattr(self.module(), f"{self.prefix}RotaryEmbedding")

    def attention_class(self):
        return getattr(self.module(), f"{self.prefix}Attention")

    def causal_lm_class(self):
        return getattr(self.module(), f"{self.prefix}ForCausalLM")

    def config_class(self):
        config = importlib.import_module(f"transformers.models.{self.model_type}.configuration_{self.model_type}")
        return getattr(config, f"{self.prefix}Config")


_ALREADY_MLA = "the model already uses MLA"

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "Llama"),
    Family("mistral", "Mistral", sliding_window="config", qkv_bias=False, o_bias=False, mlp_bias=False),
    Family("qwen2", "Qwen2", sliding_window="module", qkv_bias=True, o_bias=False, mlp_bias=False),
    Family("phi3", "Phi3", qkv=("qkv_proj",), gate_up=("gate_up_proj",), attention=None, qkv_bias=False,
           o_bias=False, mlp_bias=False),
    Family("deepseek_v3", "DeepseekV3", attention="latent", mla_refusal=_ALREADY_MLA, mlp_bias=False),
    Family("deepseek_v2", "DeepseekV2", attention=None, mla_refusal=_ALREADY_MLA),
    Family("gemma2", "Gemma2", attention=None, mla_refusal=(
        "Gemma-2 has sandwich norms (post-attention/post-feedforward RMSNorm), attention-logit softcapping "
        "and final-logit softcapping, which a DeepSeek-V3 checkpoint cannot express")),
    *(Family(name, "Gemma3", attention=None, mla_refusal=(
        "Gemma-3 (QK-norm, sandwich norms, scaled embeddings, sliding-window layers) is not converted yet: a "
        "DeepSeek-V3 checkpoint cannot express it and attnkit's MLA format for QK-norm families does not cover "
        "its layers")) for name in ("gemma3", "gemma3_text")),
    Family("qwen3", "Qwen3", attention=None, qk_norm="head", sliding_window="module", mlp_bias=False),
    Family("olmo2", "Olmo2", attention=None, qk_norm="all", norms=(None, None), mlp_bias=False,
           post_norms=("post_attention_layernorm", "post_feedforward_layernorm"), native_refusal=(
               "OLMo-2 normalises the attention and MLP outputs (post-norm blocks, Olmo2DecoderLayer), which the "
               "pre-norm layers of DeepSeek-V3 cannot express")),
)}
