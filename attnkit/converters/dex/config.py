"""`--to dex`'s options (`DexConfig`): which heads get the differential operation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from attnkit.options import option


@dataclass
class DexConfig:
    GROUP: ClassVar[str | None] = "DEX (--to dex, mla+dex)"
    heads: str = option("auto", "auto | all | FRACTION in (0, 1]: heads that get the differential op")
    heads_fraction: float = option(0.5, "fraction of heads per layer that `auto` selects")

    def check(self) -> None:
        """The head rule is refused before any model is looked at."""
        from attnkit.converters.dex.heads import parse_heads

        parse_heads(self.heads, self.heads_fraction)
