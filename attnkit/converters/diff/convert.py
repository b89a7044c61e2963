"""`attnkit convert --to diff`: the shared in-place retrofit with DIFF's fields and norm weights."""

from __future__ import annotations

import argparse

import torch

from attnkit.converters.diff.layer import diff_config_fields, norm_weights
from attnkit.converters.retrofit import ANNEAL_FRACTION, RetrofitMethod, retrofit

DEPARTURES = ("second map = new zero-initialised query on the shared keys (no cache change); heads not paired; "
              "lambda and per-head RMSNorm ramped in from 0 by the fine-tune schedule")


def convert_diff(args: argparse.Namespace) -> int:
    return retrofit(args, RetrofitMethod("diff", _fields, _init_norms))


def _fields(args: argparse.Namespace, stats: dict, model_type: str, layers: int) -> tuple[dict, dict]:
    extras = {"diff": {"head_output_rms": [[round(float(s), 6) for s in row] for row in stats["head_rms"]],
                       "departures": DEPARTURES}}
    return diff_config_fields(ANNEAL_FRACTION, model_type, layers), extras


def _init_norms(attn: torch.nn.Module, stats: dict) -> None:
    """Each head's norm weight from its measured output RMS (the branch starts at the head's scale)."""
    head_dim = attn.diff.norm_weight.shape[1]
    attn.diff.norm_weight.data.copy_(norm_weights(stats["head_rms"][attn.layer_idx], attn.layer_idx, head_dim))
