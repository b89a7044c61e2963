"""`--to gqa`'s options (`GQAConfig`): how many KV heads, and how heads are merged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from attnkit.options import option


@dataclass
class GQAConfig:
    GROUP: ClassVar[str | None] = "GQA (--to gqa)"
    kv_heads: int | None = option(None, "KV heads per layer of the output (divides the source's)", metavar="N")
    merge: str = option("aligned", "aligned: Procrustes-aligned heads, similarity groups, weighted merge, o_proj "
                        "refit; mean: contiguous groups, plain mean", choices=("aligned", "mean"))
