"""Markdown pieces of the card body, shared by its sections and by the methods' own card hooks."""

from __future__ import annotations

import json
import math
from typing import Any


def fmt(value: Any) -> str:
    """One table cell: 4 significant digits, yes/no, – for none, JSON for structures, pipes escaped."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return "–"
    if isinstance(value, (dict, list)):
        return "`" + json.dumps(value, sort_keys=True) + "`"
    return str(value).replace("|", "\\|").replace("\n", " ")


def with_stderr(value: Any, stderr: Any) -> Any:
    """'0.3633 ± 0.031' when the metric has a numeric stderr, else the value itself."""
    if isinstance(stderr, (int, float)) and not isinstance(stderr, bool) and math.isfinite(stderr) and value is not None:
        return f"{fmt(value)} ± {stderr:.2g}"
    return value


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table, every cell through `fmt`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def details(summary: str, data: dict) -> str:
    """A collapsed JSON block: complete, but out of the reader's way."""
    return "\n".join(["<details><summary>" + summary + "</summary>", "", "```json", json.dumps(data, indent=2, sort_keys=True, default=str), "```", "", "</details>"])
