"""`attnkit convert`: dispatch `--to` to the pipeline that implements it."""

from __future__ import annotations

import argparse

from attnkit.cli import load_handler

PIPELINES = {
    "mla": "attnkit.io.mla_pipeline:convert",
    "dex": "attnkit.converters.retrofit:convert_dex",
    "diff": "attnkit.converters.retrofit:convert_diff",
    "mla+dex": "attnkit.converters.retrofit:convert_mla_dex",
}


def main(args: argparse.Namespace) -> int:
    return load_handler(PIPELINES[args.to], f"attnkit convert --to {args.to}")(args) or 0
