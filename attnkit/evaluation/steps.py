"""The words of a conversion report's step table ("step alone": what each step does by itself), shared by
the converters that print it and the model card that tables it."""

from __future__ import annotations

ALONE = {
    "exact": "exact: logits unchanged but for float rounding",
    "lossy": "lossy: approximates",
    "lossy fold": "lossy fold: QK norms as constant scales",
    "rounding": "rounding: to the output dtype only",
    "engine form": "engine form: latent norm without a bias, lossy (healing recovers it)",
    "fitted": "fitted: every weight trained to the source layer's output (--fit-steps), lowers the loss",
}


def step_alone(step: dict) -> str:
    """A report step's `alone` word; reports without it (converters and releases that
    wrote only `exact`) from their `exact` flag."""
    return step.get("alone") or ("exact" if step.get("exact") else "lossy")
