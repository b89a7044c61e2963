"""Check the `auto` rule of absorbed MLA: time both paths of one attention layer and compare with its pick.

For each (new tokens Q, cached tokens before the call), one DeepSeek-V3 attention layer of the converted
reference shape (benchmarks/reference_shapes.py) runs `absorbed` and `expanded`; the table shows both
times (process CPU time: steady on a shared machine; use --threads 1), the faster one, and what `auto`
(fewest multiply-adds) picks.

    python benchmarks/prefill_rule.py [--threads 1] [--kv-lora-rank 61] [--rope-dim 16] [--repeats 3]
"""

import argparse
import time

import torch
from transformers import DynamicCache
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

from attnkit.adapters.mla import AbsorbedDeepseekV3Attention, latent_layer

from reference_shapes import mla_config, reference_llama_config

CASES = [(1, 1024), (1, 16384), (16, 4096), (64, 4096), (256, 0), (1024, 0), (4096, 0), (1024, 7168)]


def time_call(attn, mode: str, hidden, rope, prefix: torch.Tensor, repeats: int) -> float:
    """Median CPU seconds of one attention call on Q new tokens after `prefix` cached latents."""
    attn.attnkit_mode = mode
    times = []
    for _ in range(repeats):
        cache = DynamicCache()
        if prefix.shape[2]:  # a filled latent layer, as during generation (not timed)
            latent_layer(cache, 0).update(prefix[..., : attn.kv_lora_rank], prefix[..., attn.kv_lora_rank :])
        t0 = time.process_time()
        attn(hidden, rope, None, cache=cache)
        times.append(time.process_time() - t0)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-lora-rank", type=int, default=61)
    p.add_argument("--rope-dim", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = mla_config(reference_llama_config(), args.kv_lora_rank, args.rope_dim)
    attn = ds.DeepseekV3Attention(cfg, 0).eval()
    attn.__class__ = AbsorbedDeepseekV3Attention
    rotary = ds.DeepseekV3RotaryEmbedding(cfg)
    print(f"{'Q':>5} {'cached':>6} | {'absorbed ms':>11} {'expanded ms':>11} | faster   | auto picks")
    for q_len, cached in CASES:
        hidden = torch.randn(1, q_len, cfg.hidden_size)
        rope = rotary(hidden, torch.arange(cached, cached + q_len)[None])
        prefix = torch.randn(1, 1, cached, args.kv_lora_rank + args.rope_dim)
        t_abs = time_call(attn, "absorbed", hidden, rope, prefix, args.repeats)
        t_exp = time_call(attn, "expanded", hidden, rope, prefix, args.repeats)
        attn.attnkit_mode = "auto"
        pick = "absorbed" if attn.use_absorbed(q_len, cached + q_len) else "expanded"
        faster = "absorbed" if t_abs <= t_exp else "expanded"
        print(f"{q_len:>5} {cached:>6} | {1e3 * t_abs:>11.2f} {1e3 * t_exp:>11.2f} | {faster:<8} | {pick}")


if __name__ == "__main__":
    main()
