"""`attnkit convert`: dispatch `--to` to the pipeline that implements it."""

from __future__ import annotations

import argparse

from attnkit.cli import load_handler

PIPELINES = {
    "mla": "attnkit.converters.mla.convert:convert",
    "dex": "attnkit.converters.dex.convert:convert_dex",
    "diff": "attnkit.converters.diff.convert:convert_diff",
    "mla+dex": "attnkit.converters.dex.convert:convert_mla_dex",
    "titans": "attnkit.converters.titans.convert:convert_titans",
    "mla+titans": "attnkit.converters.titans.convert:convert_mla_titans",
    "gqa": "attnkit.converters.gqa.convert:convert",
}


def main(args: argparse.Namespace) -> int:
    return load_handler(PIPELINES[args.to], f"attnkit convert --to {args.to}")(args) or 0
