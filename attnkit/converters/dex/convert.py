"""`attnkit convert --to dex` and `--to mla+dex`: the shared in-place retrofit with DEX's fields."""

from __future__ import annotations

import argparse
import copy
import json

from attnkit.converters.dex.heads import dex_config_fields, parse_heads, select_heads
from attnkit.converters.mla.convert import convert as convert_mla
from attnkit.converters.retrofit import ANNEAL_FRACTION, retrofit
from attnkit.io.checkpoint import check_output_dir, scratch_dir
from attnkit.io.resolve import resolve_model

SCORE = "normalised attention entropy on calibration text (higher = more diffuse); top ceil(fraction*H) per layer"


def convert_dex(args: argparse.Namespace) -> int:
    parse_heads(args.heads, args.heads_fraction)  # refuse bad input before any work
    return retrofit(args, "dex", _fields("dex"))


def convert_mla_dex(args: argparse.Namespace) -> int:
    """MLA first (the MLA driver, into a scratch folder beside OUT that a killed run's successor
    removes), then DEX on its DeepSeek-V3 output; the report's "before" is the user's model."""
    parse_heads(args.heads, args.heads_fraction)  # refuse bad input before the long MLA step
    original = resolve_model(args.model)
    check_output_dir(args.out, args.force, (original,))
    with scratch_dir(args.out) as scratch:
        mla_out = scratch / "mla"
        mla_args = copy.copy(args)
        mla_args.to, mla_args.out, mla_args.force = "mla", str(mla_out), False
        convert_mla(mla_args)
        prior = json.loads((mla_out / "attnkit_report.json").read_text())
        return retrofit(args, "mla+dex", _fields("mla+dex"), source_path=mla_out, prior=prior, original_path=original)


def _fields(method: str):
    def fields(args: argparse.Namespace, stats: dict, model_type: str, layers: int) -> tuple[dict, dict]:
        rule, fraction = parse_heads(args.heads, args.heads_fraction)
        entropy = stats["entropy"]  # [L, H]
        selected = select_heads(entropy, rule, fraction)
        heads = {"rule": rule, "fraction": fraction, "score": SCORE,
                 "scores": [[round(float(s), 6) for s in row] for row in entropy],
                 "selected": selected, "num_heads": int(entropy.shape[1])}
        return dex_config_fields(selected, ANNEAL_FRACTION, model_type, method), {"heads": heads}

    return fields
