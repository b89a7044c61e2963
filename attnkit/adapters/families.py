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
    # where transformers keeps the family when not under its model_type (gemma3_text lives in gemma3),
    # and the config class's prefix when not `prefix` (Gemma3TextConfig)
    package: str | None = None
    config_prefix: str | None = None
    embed_scale: bool = False  # the embedding is multiplied by sqrt(hidden_size) (Gemma)
    norm_offset: float = 0.0  # RMSNorms scale by (norm_offset + weight): 1 for Gemma's (1 + w)
    final_softcap: str | None = None  # config field of the final-logit softcapping (cap * tanh(logits / cap))
    # per layer, config.layer_types[i] picks the RoPE tables (the rotary module takes the layer type:
    # Gemma-3's local and global bases) and, for "sliding_attention", the window (attn.sliding_window)
    by_layer_type: bool = False
    # config fields that must be unset / false for `convert --to mla`, with why (checked on the config)
    mla_unsupported: tuple[tuple[str, str], ...] = ()

    def module(self):
        name = self.package or self.model_type
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")

    def decoder_layer_class(self):
        return getattr(self.module(), f"{self.prefix}DecoderLayer")

    def rotary_class(self):
        return getattr(self.module(), f"{self.prefix}RotaryEmbedding")

    def attention_class(self):
        return getattr(self.module(), f"{self.prefix}Attention")

    def causal_lm_class(self):
        return getattr(self.module(), f"{self.prefix}ForCausalLM")

    def config_class(self):
        name = self.package or self.model_type
        config = importlib.import_module(f"transformers.models.{name}.configuration_{name}")
        return getattr(config, f"{self.config_prefix or self.prefix}Config")


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
    Family("gemma3", "Gemma3", attention=None, mla_refusal=(
        "model_type gemma3 is the multimodal Gemma-3 (Gemma3ForConditionalGeneration: a vision tower, image tokens "
        "that attend bidirectionally), which is not converted; its text model (model_type gemma3_text, "
        "Gemma3ForCausalLM, e.g. gemma-3-1b) converts with --format attnkit")),
    Family("gemma3_text", "Gemma3", package="gemma3", config_prefix="Gemma3Text", attention=None, qk_norm="head",
           sliding_window="module", mlp_bias=False, norms=("input_layernorm", "pre_feedforward_layernorm"),
           post_norms=("post_attention_layernorm", "post_feedforward_layernorm"), embed_scale=True, norm_offset=1.0,
           final_softcap="final_logit_softcapping", by_layer_type=True, mla_unsupported=(
               ("attn_logit_softcapping", "attention-logit softcapping (tanh on the scores) has no form over the "
                "shared latent"),
               ("use_bidirectional_attention", "bidirectional attention is not a causal language model's")),
           native_refusal=(
               "Gemma-3 has sandwich norms (post-attention/post-feedforward RMSNorm), (1 + w) RMSNorms, scaled "
               "embeddings and sliding-window layers with their own RoPE base, which DeepSeek-V3 cannot express")),
    Family("qwen3", "Qwen3", attention=None, qk_norm="head", sliding_window="module", mlp_bias=False),
    Family("olmo2", "Olmo2", attention=None, qk_norm="all", norms=(None, None), mlp_bias=False,
           post_norms=("post_attention_layernorm", "post_feedforward_layernorm"), native_refusal=(
               "OLMo-2 normalises the attention and MLP outputs (post-norm blocks, Olmo2DecoderLayer), which the "
               "pre-norm layers of DeepSeek-V3 cannot express")),
)}
