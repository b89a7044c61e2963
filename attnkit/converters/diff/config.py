"""`--to diff`'s options: none beyond the common ones (every head gets its second map; the per-head
norms start from the calibration statistics). The class exists so the API is the same for every method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass
class DiffConfig:
    GROUP: ClassVar[str | None] = None
