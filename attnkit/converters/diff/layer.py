"""DIFF conversion math: the per-head RMSNorm initialisation and the new config.

The retrofit (attnkit/adapters/diff.py) blends `(1 − λ_init)·RMSNorm(O_h)·w_h` in as the schedule
ramps. With w_h = E_tokens[rms(O_h)] / (1 − λ_init), measured on calibration text, the normalised
branch has on average the scale of the head output it replaces, so turning the norm on changes the
direction statistics of O_h, not its size.
"""

from __future__ import annotations

import torch

from attnkit.adapters.dex import lambda_init_for_layer


def head_rms(out: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Per-head sum over tokens of rms(O_h) and the token count; out: [B, T, H, d_v]. In fp64, one row
    of the batch at a time: a whole calibration batch in fp64 is 4x its fp32 bytes (0.13 GB on a 1B
    model, at the conversion's peak)."""
    total = torch.zeros(out.shape[2], dtype=torch.float64)
    for row in out:  # [T, H, d_v]
        total += row.double().pow(2).mean(-1).sqrt().sum(0)  # [H]
    return total, int(out.shape[0] * out.shape[1])


def norm_weights(mean_rms: torch.Tensor, layer_idx: int, head_dim: int) -> torch.Tensor:
    """mean_rms [H] → RMSNorm weight [H, d_v] for layer `layer_idx`."""
    scale = 1.0 - lambda_init_for_layer(layer_idx)
    return (mean_rms.float() / scale).clamp_min(1e-6).view(-1, 1).expand(-1, head_dim).contiguous()


def diff_config_fields(anneal_fraction: float, base_model_type: str, layers: int) -> dict:
    """The `attnkit` block of a DIFF model's config."""
    return {
        "method": "diff",
        "base_model_type": base_model_type,
        "anneal_fraction": float(anneal_fraction),
        "lambda_init": [round(lambda_init_for_layer(i), 6) for i in range(layers)],
        "second_map": "doubled query (diff_q_proj, zero init), shared keys",
    }
