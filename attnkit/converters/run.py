"""`attnkit convert`: dispatch `--to` to the pipeline that implements it."""

from __future__ import annotations

import argparse
import importlib

from attnkit.errors import AttnkitError

PIPELINES = {
    "mla": "attnkit.io.mla_pipeline:convert",
    "dex": "attnkit.converters.retrofit:convert_dex",
    "diff": "attnkit.converters.retrofit:convert_diff",
    "mla+dex": "attnkit.converters.retrofit:convert_mla_dex",
}


def main(args: argparse.Namespace) -> int:
    module_name, func = PIPELINES[args.to].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("attnkit"):
            raise AttnkitError(f"`attnkit convert --to {args.to}` is not available yet in this version") from None
        raise
    return getattr(module, func)(args) or 0
