"""How much of a QK-norm model's quality can a native DeepSeek-V3 checkpoint keep? (issue 14's fold)

    python benchmarks/qknorm_fold_bound.py [--model reference-qwen3] [--rows 8] [--out fold_bound.json]

No compression here: each variant swaps the source's per-head q/k RMSNorms (Qwen3) for what a
DeepSeek-V3 config can express and measures held-out perplexity (validation split, 512-token rows), so
the figures bound what `convert --to mla --format deepseek_v3` can reach at *any* cache size, before
healing. Per side, the scale each token's query or key is divided by is

* exact   its own RMS (the source);
* const   one constant per head: what `--format deepseek_v3` folds today (here the mean of 1/RMS over
          the calibration tokens, not the converter's least-squares γ);
* shared  the RMS over all heads of the token, times one constant per head (queries: a `q_a_layernorm`
          over a full-width q latent; keys: one norm over both KV heads);
* latent  keys only, the full-rank limit of normalising a latent of keys and values with
          `kv_a_layernorm`: the key's and the value's scale are both 1/sqrt(|k|² + ε²|v̄|²) (v̄: the values
          rescaled to the keys' mean size), times constants (`latent-ε`); `latent-ε-ropeN` leaves the N
          highest-frequency pairs (DeepSeek-V3's unnormalised RoPE key) at the constant scale.

Constants come from calibration rows of the training split. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from attnkit.data import pack_tokens
from attnkit.io.resolve import resolve_model


def rms(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return x.pow(2).mean(dim=dims, keepdim=True).add(1e-6).sqrt()


class Side(torch.nn.Module):
    """Replaces a q_norm / k_norm ([B, T, n, d] in, same out) with one of the scalings above. For
    `latent` it reads the per-token factor the paired value projection's wrapper left in `box`."""

    def __init__(self, norm: torch.nn.Module, calib: torch.Tensor, mode: str, box: dict, keep: torch.Tensor):
        super().__init__()
        self.norm, self.mode, self.box, self.keep = norm, mode, box, keep  # keep [d]: dims scaled per token
        self.w = norm.weight.detach()
        inv = 1 / rms(calib, (-1,))  # [B, T, n, 1]
        self.const = inv.mean(dim=(0, 1))  # [n, 1]
        if mode == "shared":
            self.c = (rms(calib, (-1, -2)) * inv).mean(dim=(0, 1))  # [n, 1]
        elif mode == "latent":
            self.c = inv.mean(dim=(0, 1)) / box["calib_f"].mean(dim=(0, 1))  # [n, 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, n, d]
        if self.mode == "exact":
            return self.norm(x)
        if self.mode == "const":
            return x * self.const * self.w
        if self.mode == "shared":
            return x / rms(x, (-1, -2)) * self.c * self.w
        per_token = self.box["f"][..., None, None] * self.c  # [B, T, n, 1]
        return x * torch.where(self.keep, per_token, self.const) * self.w


def latent_factor(k: torch.Tensor, v: torch.Tensor, eps: float, v_scale: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(|k|² + ε² |v̄|²) per token, [B, T, 1]: the RMS a kv_a_layernorm divides by (full rank)."""
    return 1 / (k.pow(2).mean(-1, keepdim=True) + eps**2 * (v_scale * v).pow(2).mean(-1, keepdim=True)).sqrt()


class ValueScaled(torch.nn.Module):
    """v_proj whose output is multiplied by the latent's factor relative to its mean (keys and values
    share the normalised latent); the factor is the one KeyProj left for the same input."""

    def __init__(self, v_proj, mean_f: torch.Tensor, box: dict):
        super().__init__()
        self.v_proj, self.mean_f, self.box = v_proj, mean_f, box

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v_proj(x) * self.box["f"][..., None] / self.mean_f


class KeyProj(torch.nn.Module):
    """k_proj that also leaves the latent factor in `box` (Qwen3Attention calls k_proj before v_proj)."""

    def __init__(self, k_proj, v_proj, eps: float, v_scale: torch.Tensor, box: dict):
        super().__init__()
        self.k_proj, self.v_proj, self.eps, self.v_scale, self.box = k_proj, v_proj, eps, v_scale, box

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.k_proj(x)
        self.box["f"] = latent_factor(k, self.v_proj(x), self.eps, self.v_scale)[..., 0]  # [B, T]
        return k


def rope_keep(d: int, n_pairs: int) -> torch.Tensor:
    """[d] bool: False at the n highest-frequency rotate-half pairs (index j and j + d/2)."""
    keep = torch.ones(d, dtype=torch.bool)
    keep[:n_pairs] = False
    keep[d // 2 : d // 2 + n_pairs] = False
    return keep


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="reference-qwen3")
    ap.add_argument("--rows", type=int, default=8, help="held-out rows of 512 tokens")
    ap.add_argument("--calib-rows", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    calib = pack_tokens(tok, "python", "train", 512, args.calib_rows * 512, 0)
    held = pack_tokens(tok, "python", "validation", 512, args.rows * 512, 0)
    attns = [layer.self_attn for layer in model.model.layers]
    source = [(a.q_norm, a.k_norm, a.k_proj, a.v_proj) for a in attns]
    d = attns[0].head_dim

    seen: dict[tuple[int, str], torch.Tensor] = {}  # the source's q/k/v projections on the calibration rows
    hooks = [getattr(a, f"{s}_proj").register_forward_hook(
        lambda m, i, o, key=(n, s): seen.__setitem__(key, o.detach())) for n, a in enumerate(attns) for s in "qkv"]
    with torch.no_grad():
        model(calib)
    for h in hooks:
        h.remove()

    def install(q_mode: str, k_mode: str, eps: float = 0.0, rope_pairs: int = 0) -> None:
        for n, a in enumerate(attns):
            q_norm, k_norm, k_proj, v_proj = source[n]
            H, G = a.config.num_attention_heads, a.config.num_key_value_heads
            q, k, v = (seen[(n, s)] for s in "qkv")
            box: dict = {}
            a.k_proj, a.v_proj = k_proj, v_proj
            if k_mode == "latent":
                v_scale = (k.pow(2).mean() / v.pow(2).mean()).sqrt()
                f = latent_factor(k, v, eps, v_scale)  # [B, T, 1]
                box["calib_f"] = f[..., None]  # [B, T, 1, 1]
                a.k_proj = KeyProj(k_proj, v_proj, eps, v_scale, box)
                a.v_proj = ValueScaled(v_proj, f.mean(), box)
            keep = rope_keep(d, rope_pairs)
            a.q_norm = Side(q_norm, q.unflatten(-1, (H, d)), q_mode, box, torch.ones(d, dtype=torch.bool))
            a.k_norm = Side(k_norm, k.unflatten(-1, (G, d)), k_mode, box, keep)

    variants = [("exact", "exact"), ("const", "exact"), ("shared", "exact"), ("exact", "const"), ("const", "const"),
                ("shared", "const"), ("exact", "shared"), ("shared", "shared")]
    variants += [("shared", "latent", eps, 0) for eps in (0.0, 0.5, 1.0)]
    variants += [("shared", "latent", 0.5, n) for n in (8, 16)]
    rows = []
    for v in variants:
        install(*v)
        with torch.no_grad():
            ppl = math.exp(model(held, labels=held).loss.item())
        name = v[1] if len(v) == 2 else f"latent-{v[2]:g}" + (f"-rope{v[3]}" if v[3] else "")
        rows.append({"queries": v[0], "keys": name, "ppl": ppl})
        rows[-1]["x_source"] = ppl / rows[0]["ppl"]
        print(f"queries {v[0]:7s} keys {name:16s} ppl {ppl:8.3f}  x{rows[-1]['x_source']:.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"model": str(path), "held_out_tokens": held.numel(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
