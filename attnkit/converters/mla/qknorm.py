"""QK-norm sources (Qwen3) -> MLA: what the MLA math sees of a layer, and the `attnkit` format.

The MLA math (`layer.py`) needs q, k, v as linear maps of one input with a second moment. Two ways
to give it that for a layer whose queries and keys pass through an RMSNorm before RoPE:

* **lifted** (`--format attnkit`, exact): the input is y = [q̂ (H·d); k̂ (G·d); v (G·d)], the normalised
  queries and keys and the values of each token, and the layer's weights on y are selections
  ([I 0 0], [0 I 0], [0 0 I]). Every step (RoPE, balance, PCA, query refit) then runs unchanged, on
  the normalised keys, with calibration moments E[ỹ ỹᵀ] taken after the norm. The latent it builds
  reads only the k̂ and v columns (c = P [k̂; v]) and each query head only its own q̂ block, which is
  exactly what `adapters/modeling_attnkit_mla.py` computes.
* **folded** (`--format deepseek_v3`, lossy): each norm is replaced by its weight and one constant per
  query head, γ_h = argmin Σ (q̂_h·k̂ − γ (w_q⊙q_h)·(w_k⊙k))² over causal pairs of calibration rows
  (RoPE applied), folded into W_q; the rest of the pipeline runs on the folded weights as on Llama.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from attnkit.adapters import modeling_attnkit_mla as latent_code
from attnkit.adapters.modeling_attnkit_mla import LatentQKNormAttention, normed_qkv
from attnkit.converters.mla.layer import AttnWeights, MLAParams, Shape
from attnkit.converters.mla.rope import apply_rope

FOLD_ROWS = 4  # calibration rows whose scores fit the folded norms' constants
SHIPPED = ("modeling_attnkit_mla.py", "mla.py", "families.py")  # the format's code, copied into OUT


@dataclass
class LayerView:
    """What the MLA math sees of one source layer: its attention input as a function of the layer's
    normed hidden states, the weights on that input, the shape, and how a stage built on that input
    runs on the normed hidden states."""

    attn_input: Callable[[torch.Tensor], torch.Tensor]  # x [B, T, D] -> the math's input [B, T, D']
    aw: AttnWeights
    shape: Shape  # D = D'
    info: dict  # per-layer report fields (the folded norms' constants)

    def wrap(self, attend: Callable) -> Callable:
        return lambda x: attend(self.attn_input(x))


def lifted_input(attn: torch.nn.Module, shape: Shape, qk_norm: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [B, T, D] -> y = [q̂; k̂; v] [B, T, (H + 2G) d], as the shipped code computes it: the exact view's
    input, and what the folded view's constants are fitted to."""
    return lambda x: torch.cat(normed_qkv(attn, qk_norm, x, shape.H, shape.G, shape.d), dim=-1)


def lifted_view(attn: torch.nn.Module, aw: AttnWeights, shape: Shape, qk_norm: str) -> LayerView:
    """The exact view: input y = [q̂; k̂; v], weights = selections (module docstring)."""
    H, G, d = shape.H, shape.G, shape.d
    eye = torch.eye((H + 2 * G) * d)  # [D', D'] rows: q̂ (H d), k̂ (G d), v (G d)
    lifted = AttnWeights(eye[: H * d], eye[H * d : (H + G) * d], eye[(H + G) * d :], aw.wo, bo=aw.bo)
    return LayerView(lifted_input(attn, shape, qk_norm), lifted, Shape((H + 2 * G) * d, H, G, d), {})


def norm_weight(norm: torch.nn.Module, width: int) -> torch.Tensor:
    """The effective elementwise weight of an RMSNorm of any family (w, or 1 + w for Gemma): its
    output on a constant vector of RMS 1000, which the norm maps to RMS 1 (the epsilon is negligible
    there). Not divided by 1000: that made w 1000x too small, γ 10⁶x too large, the folded keys
    1000x small and the folded queries 1000x large (the same scores, but no optimizer could heal it)."""
    big = torch.full((width,), 1000.0, device=next(norm.parameters()).device)
    with torch.no_grad():
        return norm(big).detach().float().cpu()


def fold_scales(q_hat: torch.Tensor, k_hat: torch.Tensor, q_lin: torch.Tensor, k_lin: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """γ [H]: per query head, the least-squares scale of the linear scores q_lin·k_lin (RoPE'd) onto the
    source's q̂·k̂ over causal pairs. Inputs [B, T, H or G, d]; cos/sin [T, d] rotate-half tables."""
    T = q_hat.shape[1]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    num = torch.zeros(q_hat.shape[2], dtype=torch.float64)
    den = torch.zeros_like(num)
    rope = lambda t: apply_rope(t.transpose(1, 2).double(), cos.double(), sin.double())  # noqa: E731  [B, n, T, d]
    qh, kh, ql, kl = rope(q_hat), rope(k_hat)[:, group], rope(q_lin), rope(k_lin)[:, group]
    for h in range(q_hat.shape[2]):  # one head at a time: [B, T, T] scores
        src = (qh[:, h] @ kh[:, h].transpose(-1, -2))[:, causal]
        lin = (ql[:, h] @ kl[:, h].transpose(-1, -2))[:, causal]
        num[h], den[h] = (src * lin).sum(), (lin * lin).sum()
    return (num / den.clamp_min(1e-30)).float()


def folded_view(attn: torch.nn.Module, aw: AttnWeights, shape: Shape, qk_norm: str, x: torch.Tensor,
                pe: tuple[torch.Tensor, torch.Tensor]) -> LayerView:
    """The lossy view: norms folded into W_q / W_k as their weights times a constant per query head,
    fitted on the normed inputs x [B, T, D] of calibration rows (positions' tables `pe`)."""
    H, G, d = shape.H, shape.G, shape.d
    width_q, width_k = (H * d, G * d) if qk_norm == "all" else (d, d)
    w_q = norm_weight(attn.q_norm, width_q).repeat(H * d // width_q)  # [H d]
    w_k = norm_weight(attn.k_norm, width_k).repeat(G * d // width_k)  # [G d]
    with torch.no_grad():
        y = lifted_input(attn, shape, qk_norm)(x)  # [B, T, (H + 2G) d]
        q_hat, k_hat = y[..., : H * d], y[..., H * d : (H + G) * d]
        q_lin, k_lin = attn.q_proj(x) * w_q.to(x.device), attn.k_proj(x) * w_k.to(x.device)
    cos, sin = (t[0, : x.shape[1]].cpu() for t in pe)
    heads = lambda t, n: t.detach().cpu().unflatten(-1, (n, d))  # noqa: E731  [B, T, n, d]
    gamma = fold_scales(heads(q_hat, H), heads(k_hat, G), heads(q_lin, H), heads(k_lin, G), cos, sin, shape.group)
    q_scale = gamma.repeat_interleave(d) * w_q  # [H d]
    folded = AttnWeights(aw.wq * q_scale[:, None], aw.wk * w_k[:, None], aw.wv, aw.wo,
                         None if aw.bq is None else aw.bq * q_scale, None if aw.bk is None else aw.bk * w_k, aw.bv, aw.bo)
    return LayerView(lambda x: x, folded, shape, {"qk_norm_fold_scale": gamma.tolist()})


# ---------------------------------------------------------------- the attnkit format


def attnkit_config(hf_config, family, kv_lora_rank: int, rope_pairs: list[int]):
    """The output's config: the source's fields, model_type attnkit_mla_<family>, `attnkit` and `auto_map`."""
    config_class = latent_code.CLASSES[family.model_type][0]
    fields = {k: v for k, v in hf_config.to_dict().items() if k not in ("model_type", "architectures", "auto_map", "transformers_version")}
    config = config_class(**fields)
    config.attnkit = {"method": "mla", "base_model_type": family.model_type, "kv_lora_rank": int(kv_lora_rank),
                      "rope_pairs": [int(i) for i in rope_pairs]}
    config.auto_map = latent_code.auto_map(family.model_type)
    config.architectures = [latent_code.CLASSES[family.model_type][1].__name__]
    return config


def attnkit_tensors(p: MLAParams, shape: Shape, attn: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`self_attn.*` tensors of one layer in the attnkit format, from a stage built on the lifted view
    (shape: the source's, D = hidden size): the source's q/k/v projections and norms, then
    q_map [H, d + d_r, d] (each head's own q̂ block of q_w), kv_a_proj ([k̂; v] columns of the latent and
    RoPE-key rows), kv_b_proj, and o_proj with the value bias folded in (a key bias is dropped: it adds
    the same score to every key of a query, which softmax ignores)."""
    H, G, d = shape.H, shape.G, shape.d
    Hd = H * d
    t = {n: v.detach() for n, v in attn.state_dict().items() if n.split(".")[0] in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm")}
    t["q_map"] = torch.stack([p.q_w[h][:, h * d : (h + 1) * d] for h in range(H)])  # [H, d + d_r, d]
    t["kv_a_proj.weight"] = torch.cat([p.lat_w[:, Hd:], p.pe_w[:, Hd:]])  # [m + d_r, 2 G d]
    zeros = lambda n: torch.zeros(n, dtype=p.lat_w.dtype)  # noqa: E731
    t["kv_a_proj.bias"] = torch.cat([zeros(p.lat_w.shape[0]) if p.lat_b is None else p.lat_b,
                                     zeros(p.pe_w.shape[0]) if p.pe_b is None else p.pe_b])
    t["kv_b_proj.weight"] = p.kvb_w.reshape(H * 2 * d, -1)
    o_b = torch.zeros(shape.D, dtype=p.o_w.dtype) if p.o_b is None else p.o_b.clone()
    if p.kvb_b is not None:  # value bias through o_proj: o(v + b) = o v + o b
        o_b = o_b + p.o_w @ p.kvb_b[:, d:].reshape(Hd).to(p.o_w.dtype)
    t["o_proj.weight"], t["o_proj.bias"] = p.o_w, o_b
    return t


def attnkit_module(config, layer: int, tensors: dict[str, torch.Tensor], dev: str) -> LatentQKNormAttention:
    """The written layer as the format runs it (fp32 on `dev`), to measure what is written."""
    with torch.device("meta"):
        module = LatentQKNormAttention(config, layer)
    module.load_state_dict({n: v.float().to(dev) for n, v in tensors.items()}, strict=True, assign=True)
    return module.eval()


def write_code(folder: Path) -> None:
    """Copy the format's modeling code beside the weights (config.json's auto_map names it)."""
    here = Path(latent_code.__file__).parent
    for name in SHIPPED:
        shutil.copy2(here / name, folder / name)


def format_note(family, fmt: str) -> str | None:
    """One line on the format a QK-norm source is written in, and why (None for other families)."""
    if family.qk_norm is None:
        return None
    name = family.prefix
    if fmt == "attnkit":
        alternative = ("--format deepseek_v3 is not available for it (the rest of the model has no DeepSeek-V3 form)"
                       if family.native_refusal else
                       "--format deepseek_v3 writes a plain checkpoint with the norms folded (lossy)")
        return (f"format attnkit (exact): {name} normalises its keys before RoPE, which no latent of a DeepSeek-V3 "
                "checkpoint reproduces, so the latent is written from the normalised keys by code shipped in OUT "
                f"(trust_remote_code); {alternative}")
    return (f"format deepseek_v3: {name}'s query/key norms are folded into q/k projections as constant scales: "
            "lossy, the report's first step measures it")
