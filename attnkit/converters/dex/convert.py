"""`attnkit convert --to dex` and `--to mla+dex`: the shared in-place retrofit with DEX's fields."""

from __future__ import annotations

import argparse

from attnkit.converters.dex.heads import dex_config_fields, parse_heads, select_heads
from attnkit.converters.mla.convert import convert as convert_mla
from attnkit.converters.retrofit import ANNEAL_FRACTION, RetrofitMethod, retrofit, retrofit_after_mla

SCORE = "normalised attention entropy on calibration text (higher = more diffuse); top ceil(fraction*H) per layer"


def convert_dex(args: argparse.Namespace) -> int:
    parse_heads(args.heads, args.heads_fraction)  # refuse bad input before any work
    return retrofit(args, RetrofitMethod("dex", _fields("dex")))


def convert_mla_dex(args: argparse.Namespace) -> int:
    """MLA first, then DEX on its DeepSeek-V3 output (`retrofit_after_mla`)."""
    parse_heads(args.heads, args.heads_fraction)  # refuse bad input before the long MLA step
    return retrofit_after_mla(args, RetrofitMethod("mla+dex", _fields("mla+dex")), convert_mla=convert_mla)


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


def summary(report: dict) -> tuple[str | None, list[str]]:
    """The printout's DEX line: how many heads of each layer got the differential operation."""
    sel = report["heads"]["selected"]
    return None, [f"DEX heads per layer: {[len(s) for s in sel]} of {report['heads']['num_heads']} ({report['heads']['rule']})"]
