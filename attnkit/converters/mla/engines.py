"""The engine export (`--target engines`, the default): a DeepSeek-V3 checkpoint that stays within
what llama.cpp, vLLM and SGLang implement (docs/serving.md cites their code):

- no attention biases (engines drop `kv_a_proj_with_mqa` / `o_proj` biases): the latent PCA is
  uncentred, so no constant is needed to carry a mean;
- RoPE in the interleaved (adjacent-pair) layout, `rope_interleave: true`: the RoPE rows of the
  query and of `kv_a_proj_with_mqa` are permuted, an exact change;
- a plain RoPE ladder (no frequency factors): slot s keeps source frequency pair k*s, which is
  exactly theta' = theta^(k d_r / d) for a default-RoPE source (`ladder_stride` picks k);
- `q_lora_rank = D` with `q_a_proj = diag(1 / g)`: the q latent is the input divided by its own
  RMS, whose RMS is 1 for every token, so `q_a_layernorm` (weight g) is exact with no bias;
- the latent RMSNorm: with no bias there is no constant to make it a fixed scale, and its epsilon
  cannot help (transformers fixes it at 1e-6 for `kv_a_layernorm`, llama.cpp and vLLM use
  `rms_norm_eps`). One latent channel is an *anchor*: the direction of the normed input whose
  projection varies least from token to token (Sigma^-1 mu), sized per layer (ANCHOR_RATIOS) so that
  the norm divides every token by as nearly the same number as that layer allows. Then the latent
  channels are mixed (`steady_mix`: z -> T z, any invertible T is free because `kv_b_proj` absorbs
  T^-1) so that |T z| itself is as steady as a quadratic form of the latent can be; `kv_b_proj` is
  refit by least squares on the normalised latents of calibration text (`KvbRefit`). What remains is
  a per-token scale error (the step `native` in the report measures it), which healing recovers;
- the LM head is written explicitly (vLLM does not tie DeepSeek's).
"""

from __future__ import annotations

import math

import torch

from attnkit.converters.mla.layer import MLAParams, Shape

# anchor channel's mean / the data channels' RMS norm, tried per layer (0: no anchor); the converter keeps the
# one whose kv_b refit reconstructs K and V best on calibration rows the fits did not see (`engine_fit.py`; an
# embedding layer has no steady direction to anchor on)
ANCHOR_RATIOS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)


def ladder_stride(scores: list[torch.Tensor], d: int, d_r: int) -> int:
    """Stride k of the kept source frequency pairs 0, k, 2k, … (d_r/2 of them): the k whose
    components carry the most RoPE score over all layers (each layer's best virtual head per pair)."""
    half, slots = d // 2, d_r // 2
    best = torch.stack([s / s.sum().clamp_min(1e-30) for s in scores]).amax(-1).sum(0)  # [d/2]
    strides = [k for k in range(1, half + 1) if k * (slots - 1) < half]
    return max(strides, key=lambda k: float(best[torch.arange(slots) * k].sum()))


def ladder_theta(theta: float, stride: int, d: int, d_r: int) -> float:
    """theta' whose d_r ladder theta'^(-2s/d_r) is the source's theta^(-2ks/d)."""
    return theta ** (stride * d_r / d)


def interleave(rows: torch.Tensor) -> torch.Tensor:
    """Rows [d_r, ...] from the rotate-half layout (pair i = rows i, i + d_r/2) to the adjacent-pair
    layout (pair i = rows 2i, 2i+1) that `rope_interleave: true` and llama.cpp's deepseek2 read."""
    half = rows.shape[0] // 2
    perm = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
    return rows[perm]


def anchor_row(moment: torch.Tensor, lat_w: torch.Tensor, ratio: float) -> torch.Tensor:
    """[D] weights of the anchor channel: v = Sigma^-1 mu of the normed input (the projection with the
    smallest coefficient of variation), scaled so that its mean is `ratio` times the RMS norm of the
    data channels lat_w [m, D]. moment: E[x~ x~^T] of x~ = [x; 1] (fp64)."""
    D = moment.shape[0] - 1
    mu = moment[:D, D]
    cov = moment[:D, :D] - torch.outer(mu, mu)
    cov.diagonal().add_(1e-6 * cov.diagonal().mean())  # the ridge in place: no [D, D] identity and sum (2 x 32 MB at D 2048)
    v = torch.linalg.solve(cov, mu)
    data_norm = torch.einsum("md,de,me->", lat_w, moment[:D, :D], lat_w).clamp_min(1e-30).sqrt()  # sqrt E|c|^2
    return v * (ratio * data_norm / (v @ mu).abs().clamp_min(1e-30)) * torch.sign(v @ mu)


MIX_CHANNELS = 128  # latent channels `steady_mix` mixes freely (the rest share one scale)


def steady_mix(z: torch.Tensor, spread: float = 1e-3, iters: int = 200, channels: int = MIX_CHANNELS) -> torch.Tensor:
    """[r, r] mix T of the latent channels z [N, r] that makes |T z_t|^2 as nearly the same for every
    token as it can (L-BFGS on its relative variance, from T = I): the RMSNorm after it then divides
    every token by nearly one number, i.e. is nearly linear. `spread` penalises the spread of T's log
    singular values, so no direction is shrunk to where bf16 / f16 weights would lose it (measured on
    the reference: condition numbers 9-31, the norm's coefficient of variation 1.5-3.9x smaller).

    Only the `channels` of most energy are mixed freely; the others share one scale (their squared
    norm is one feature), so a 512-wide latent costs a 128-wide fit."""
    z = z.float()  # fp32: the same fit as fp64 on the reference (norm spread to 3 digits), 4x faster
    r = z.shape[1]
    order = z.pow(2).mean(0).argsort(descending=True)
    head, rest = order[:channels], order[channels:]
    z_head, rest_sq = z[:, head], z[:, rest].pow(2).sum(-1)  # [N, k], [N]
    t = torch.eye(len(head), dtype=torch.float32, requires_grad=True)
    log_s = torch.zeros((), dtype=torch.float32, requires_grad=True)  # the shared scale of the rest
    opt = torch.optim.LBFGS([t, log_s], max_iter=iters, line_search_fn="strong_wolfe")
    best = {"value": float("inf"), "t": t.detach().clone(), "log_s": log_s.detach().clone()}  # T = I if all fails

    def loss() -> torch.Tensor:
        opt.zero_grad()
        q = (z_head @ t.T).pow(2).sum(-1) + (2 * log_s).exp() * rest_sq  # [N] squared norms
        log_sv = torch.cat([torch.linalg.svdvals(t).log(), log_s.expand(len(rest))])
        value = (q / q.mean() - 1).pow(2).mean() + spread * (log_sv - log_sv.mean()).pow(2).mean()
        seen = float(value.detach())
        if math.isfinite(seen) and seen < best["value"]:
            best.update(value=seen, t=t.detach().clone(), log_s=log_s.detach().clone())
        value.backward()
        return value

    with torch.enable_grad():
        try:
            opt.step(loss)
            fit_t, fit_log_s = t.detach(), log_s.detach()
        except torch.linalg.LinAlgError:  # a line-search step too far (its SVD does not converge)
            fit_t, fit_log_s = best["t"], best["log_s"]  # the best point evaluated before it
    if not (torch.isfinite(fit_t).all() and torch.isfinite(fit_log_s)):
        fit_t, fit_log_s = best["t"], best["log_s"]
    mix = torch.zeros(r, r, dtype=torch.float64)
    mix[head[:, None], head[None, :]] = fit_t.double()
    mix[rest, rest] = fit_log_s.double().exp()
    return mix / torch.linalg.svdvals(mix).max()  # largest singular value 1: the latent's scale unchanged at most


def norm_spread(z: torch.Tensor) -> float:
    """Coefficient of variation of the latent's norm over tokens: how far the RMSNorm is from a fixed
    scale (0: linear)."""
    n = z.double().norm(dim=-1)
    return float(n.std() / n.mean())


def normalised_latent(c: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """What `kv_a_layernorm` does before its weight: c / rms(c), per token (last dim)."""
    return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)


class KvbRefit:
    """Least squares for `kv_b_proj` on normalised latents: B = argmin sum_t |B n_t - K c_t|^2 where
    c_t is the data latent, K the low-rank stage's up-projection and n_t the normalised
    [c_t; anchor_t]. Accumulates the two moments batch by batch (fp64)."""

    def __init__(self, m: int):
        self.cross = torch.zeros(m, m + 1, dtype=torch.float64)  # sum c n^T
        self.gram = torch.zeros(m + 1, m + 1, dtype=torch.float64)  # sum n n^T
        self.data = torch.zeros(m, m, dtype=torch.float64)  # sum c c^T

    def add(self, c: torch.Tensor, n: torch.Tensor, data: torch.Tensor | None = None) -> None:
        """`data`: c^T c of these rows when the caller has it (refits of several anchor ratios share c)."""
        c, n = c.reshape(-1, c.shape[-1]).double(), n.reshape(-1, n.shape[-1]).double()
        self.cross += c.T @ n
        self.gram += n.T @ n
        self.data += c.T @ c if data is None else data

    def merged(self, other: "KvbRefit") -> "KvbRefit":
        """The refit over both sets of rows (the moments summed)."""
        both = KvbRefit(self.cross.shape[0])
        for name in ("cross", "gram", "data"):
            setattr(both, name, getattr(self, name) + getattr(other, name))
        return both

    def relative_error(self, kvb_w: torch.Tensor, kv_b: torch.Tensor) -> float:
        """sum_t |B n_t - K c_t|^2 / sum_t |K c_t|^2 for K = kvb_w and B = kv_b = solve(kvb_w): what the
        refit cannot recover. Each trace(X M Y^T) is taken as sum(M * X^T Y): [m, m] products, not
        [H 2d, H 2d] ones (8x fewer flops at H 2d = 4096, m = 511)."""
        K = kvb_w.double().reshape(-1, kvb_w.shape[-1])  # [H 2d, m]
        B = kv_b.double().reshape(K.shape[0], -1)  # [H 2d, m + 1]
        target = (self.data * (K.T @ K)).sum()
        err = target - 2 * (self.cross * (K.T @ B)).sum() + (self.gram * (B.T @ B)).sum()
        return float(err.clamp_min(0) / target.clamp_min(1e-30))

    def solve(self, kvb_w: torch.Tensor) -> torch.Tensor:
        """kvb_w [H, 2d, m] -> [H, 2d, m + 1] acting on the normalised latent."""
        ridge = 1e-8 * self.gram.diagonal().mean() * torch.eye(self.gram.shape[0], dtype=torch.float64)
        mix = torch.linalg.solve(self.gram + ridge, self.cross.T).T  # [m, m + 1]: c ~ mix n
        return kvb_w.double() @ mix


def latent_rows(lat_w: torch.Tensor, anchor: torch.Tensor, mix: torch.Tensor | None = None) -> torch.Tensor:
    """[m + 1, D] rows of `kv_a_proj_with_mqa` that make the cached latent: the data rows and the
    anchor, mixed by `steady_mix`'s T when given."""
    rows = torch.cat([lat_w.double(), anchor[None].double()])
    return rows if mix is None else mix.double() @ rows


def engine_attention_tensors(p: MLAParams, shape: Shape, g: torch.Tensor, latent: torch.Tensor,
                             kv_b: torch.Tensor) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 `self_attn.*` tensors (fp64) of one layer in the engine form.

    p: the layer's MLA parameters on the source's normed input x~ = g * u (u = x / rms(x)), with no
    latent bias (uncentred PCA); g: the input norm's weight; latent [m + 1, D]: the latent rows
    (`latent_rows`); kv_b: `KvbRefit.solve` on that latent."""
    H, d, D = shape.H, shape.d, shape.D
    m, d_r = p.lat_w.shape[0], p.pe_w.shape[0]
    g = g.double()
    inv_g = torch.where(g != 0, 1.0 / g, torch.zeros_like(g))
    # q_b_proj and o_proj are the stage's own values, only moved: kept in their dtype (the same after
    # the output cast; a [H (d + d_r), D] fp64 copy and its permuted twin were the layer's peak)
    q_w = p.q_w.reshape(H, d + d_r, D).clone()
    q_w[:, d:] = q_w[:, d:].index_select(1, interleave(torch.arange(d_r)))  # [H, d+d_r, D], rope rows permuted
    return {
        "q_a_proj.weight": torch.diag(inv_g),  # q_a = x~ / g = u: RMS 1 for every token
        "q_a_layernorm.weight": g.clone(),  # restores x~
        "q_b_proj.weight": q_w.reshape(H * (d + d_r), D),
        "kv_a_proj_with_mqa.weight": torch.cat([latent.double(), interleave(p.pe_w.double())]),
        "kv_a_layernorm.weight": torch.ones(m + 1, dtype=torch.float64),
        "kv_b_proj.weight": kv_b.reshape(H * 2 * d, m + 1),
        "o_proj.weight": p.o_w,
    }


def pad_value_heads(tensors: dict[str, torch.Tensor], heads: int, nope: int, v: int, v_new: int) -> dict[str, torch.Tensor]:
    """The same attention with value heads of v_new >= v: each head's V rows of `kv_b_proj` get
    v_new - v zero rows and `o_proj` the matching zero columns, so the extra output dims are zero
    and read by nothing (exact; the cache, which holds the latent, is unchanged)."""
    if v_new == v:
        return tensors
    kv_b = tensors["kv_b_proj.weight"].reshape(heads, nope + v, -1)  # [H, nope + v, r]
    o = tensors["o_proj.weight"].reshape(-1, heads, v)  # [D, H, v]
    pad_rows = kv_b.new_zeros(heads, v_new - v, kv_b.shape[-1])
    return {**tensors,
            "kv_b_proj.weight": torch.cat([kv_b, pad_rows], 1).reshape(heads * (nope + v_new), -1),
            "o_proj.weight": torch.cat([o, o.new_zeros(o.shape[0], heads, v_new - v)], 2).reshape(o.shape[0], -1)}


# What each engine's MLA kernels take, read from their code (docs/serving.md cites file and line):
# vLLM 0.32's MLA path (every backend, CPU and CUDA) needs a cached head of r + d_r in VLLM_MLA_SIZES
# (MLACommonMetadata's check); on CPU both backends (CPU_MLA; AMX_MLA, bf16, chosen on AMX CPUs) compile only
# 576; its CUDA prefill backends need qk_rope_head_dim 64 and (qk_nope, v) in these pairs. With MLA off
# (VLLM_MLA_DISABLE=1) vLLM runs any size but caches the expanded per-head K and V: no saving. llama.cpp
# takes any kv_lora_rank, an even RoPE dim and qk_nope >= 1; SGLang's Python code checks no size (CUDA only).
VLLM_PREFILL_HEADS = {(128, 128), (64, 128), (192, 256)}
VLLM_MLA_SIZES = (320, 512, 576)
VLLM_CPU_MLA_SIZE = 576
VLLM_ROPE_DIM = 64
# the architecture name of the transformers-only form: engines pick their model class by `architectures`
# and refuse a name they do not know, while transformers' Auto classes build it from model_type
TRANSFORMERS_ONLY_ARCHITECTURE = "AttnkitExactDeepseekV3ForCausalLM"


def engine_support(kv_lora_rank: int, rope_dim: int, nope: int, v: int, form: str,
                   rope_frequencies: str = "ladder") -> dict[str, str]:
    """Per engine: "yes", or why this checkpoint's sizes or form cannot run there (said at conversion
    time, in the report and the card, not discovered at serve time). vLLM's CPU and CUDA builds differ."""
    if form != "engines":
        factors = ", longrope factors" if rope_frequencies == "exact" else ""
        no = f"no: refused (architecture {TRANSFORMERS_ONLY_ARCHITECTURE}; biases{factors} would be dropped)"
        return {"transformers": "yes", "llama.cpp": no, "vLLM": no, "SGLang": no}
    cached = kv_lora_rank + rope_dim
    cuda = []
    if cached not in VLLM_MLA_SIZES:
        cuda.append(f"MLA caches r + d_r = {cached}, needs {'/'.join(map(str, VLLM_MLA_SIZES))}")
    if rope_dim != VLLM_ROPE_DIM or (nope, v) not in VLLM_PREFILL_HEADS:
        cuda.append(f"prefill needs d_r {VLLM_ROPE_DIM} and (nope, v) in {sorted(VLLM_PREFILL_HEADS)}, is {rope_dim}, "
                    f"({nope}, {v})")
    cpu = ("yes (CPU_MLA; AMX_MLA in bf16)" if cached == VLLM_CPU_MLA_SIZE else
           f"no: CPU_MLA/AMX_MLA cache r + d_r = {VLLM_CPU_MLA_SIZE} only, this is {cached}; "
           "VLLM_MLA_DISABLE=1 runs it with an uncompressed cache")
    return {"transformers": "yes", "llama.cpp": "yes" if nope >= 1 else "no: qk_nope_head_dim must be >= 1",
            "vLLM CUDA": "yes" if not cuda else "no: " + "; ".join(cuda), "vLLM CPU": cpu,
            "SGLang": "yes on CUDA (no size check in its code)"}


def vllm_splits(total: int, max_rank: int, rope_cap: int, cpu: bool = False) -> list[tuple[int, int]]:
    """The (kv_lora_rank, rope_dim) splits vLLM's MLA kernels take within `total` cached values per token
    and layer (d_r 64; r + d_r one of VLLM_MLA_SIZES, or 576 on CPU), largest first; `max_rank` for d_r 64."""
    sizes = (VLLM_CPU_MLA_SIZE,) if cpu else VLLM_MLA_SIZES
    if rope_cap < VLLM_ROPE_DIM:
        return []
    return [(n - VLLM_ROPE_DIM, VLLM_ROPE_DIM) for n in sorted(sizes, reverse=True)
            if n <= total and n - VLLM_ROPE_DIM <= max_rank]
