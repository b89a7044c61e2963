"""Loads a bundled task's JSONL for lm-eval (`custom_dataset: !function attnkit_data.load`).

lm-eval imports this file by its path next to the YAML, so the YAMLs in this folder work from
any location (`lm_eval --include_path "$(attnkit tasks path)"`) without templating; it reads the
data beside itself and, unlike `dataset_path: json`, writes no datasets cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"


def load(file: str, rows: int | None = None, **_ignored: Any) -> dict[str, Any]:
    """{"test": Dataset} of the first `rows` items of data/FILE (all when None).

    lm-eval also passes the task's metadata (and the CLI's model arguments): ignored here.
    """
    from datasets import Dataset

    return {"test": Dataset.from_list(read(file, rows))}


def read(file: str, rows: int | None = None) -> list[dict]:
    """The first `rows` items of data/FILE as dicts."""
    with open(DATA / file, encoding="utf-8") as fh:
        items = [json.loads(line) for line in fh if line.strip()]
    return items if rows is None else items[:rows]
