"""The model card moved to `attnkit.card` (it carries each method's own sections, which `io/` must not
know). This name stays only for the converters that still import `write_model_card` from here; new
code imports `attnkit.card.build`."""

from __future__ import annotations

from attnkit.card.build import write_model_card

__all__ = ["write_model_card"]
