"""Random-weight stand-ins with the shapes of the reference model and of its MLA conversion.

Speed does not depend on weight values, so when no converted reference checkpoint exists these give the
same timings: a GQA Llama shaped like the bundled reference (or `recipes/reference.yaml`) and a dense DeepSeek-V3 with the layout
`attnkit convert --to mla` writes (num_key_value_heads = H, qk_nope_head_dim = v_head_dim = head_dim,
q_lora_rank null, first_k_dense_replace = layers).

    python benchmarks/reference_shapes.py OUT_DIR [--kv-lora-rank 61] [--rope-dim 16]
    # writes OUT_DIR/gqa and OUT_DIR/mla (fp32 safetensors, no tokenizer: `attnkit bench` needs none)
"""

import argparse
from pathlib import Path

import torch
import yaml
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "reference.yaml"
BUNDLED = ROOT / "attnkit" / "assets" / "reference" / "config.json"


def reference_llama_config() -> LlamaConfig:
    """The reference model's LlamaConfig: the bundled checkpoint's, else its recipe's."""
    if BUNDLED.exists():
        return LlamaConfig.from_pretrained(BUNDLED.parent)
    recipe = yaml.safe_load(RECIPE.read_text())
    return LlamaConfig(vocab_size=recipe["tokenizer"]["vocab_size"], **recipe["model"])


def mla_config(src: LlamaConfig, rank: int, rope_dim: int) -> DeepseekV3Config:
    """The DeepSeek-V3 config an MLA conversion of `src` has at latent rank `rank` + rope dim `rope_dim`."""
    d = src.head_dim
    return DeepseekV3Config(
        vocab_size=src.vocab_size, hidden_size=src.hidden_size, intermediate_size=src.intermediate_size,
        num_hidden_layers=src.num_hidden_layers, num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_attention_heads, q_lora_rank=None, kv_lora_rank=rank, qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=d, v_head_dim=d, first_k_dense_replace=src.num_hidden_layers, n_routed_experts=1,
        max_position_embeddings=src.max_position_embeddings, rope_theta=src.rope_parameters["rope_theta"],
        rms_norm_eps=src.rms_norm_eps, tie_word_embeddings=src.tie_word_embeddings, rope_interleave=False,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--kv-lora-rank", type=int, default=61)
    p.add_argument("--rope-dim", type=int, default=16)
    args = p.parse_args()
    torch.manual_seed(0)
    src = reference_llama_config()
    out = Path(args.out)
    LlamaForCausalLM(src).save_pretrained(out / "gqa")
    DeepseekV3ForCausalLM(mla_config(src, args.kv_lora_rank, args.rope_dim)).save_pretrained(out / "mla")
    gqa = 2 * src.num_key_value_heads * src.head_dim
    mla = args.kv_lora_rank + args.rope_dim
    print(f"wrote {out}/gqa and {out}/mla; cache per token per layer {gqa} -> {mla} values ({100 * mla / gqa:.1f} %)")


if __name__ == "__main__":
    main()
