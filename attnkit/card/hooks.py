"""What the methods add to a card, read through the registry (`Method.card`), so this package names no
method: a method's title, and the paragraphs only its own folder can write (where its output serves,
what fine-tuning it takes, what its cache figure leaves out)."""

from __future__ import annotations

from dataclasses import dataclass, field

from attnkit import registry


@dataclass
class MethodSections:
    """One method's part of a card, each empty when the method has nothing to say about this folder.

    kv_notes: paragraphs after the KV-cache table (what the per-token figure does not tell).
    params: (a step's `params` block, how the card names that step) for a composite report that has
        no `params` of its own, e.g. `(report[step]["params"], " (its X step)")`.
    usage_notes: paragraphs after "How to load" (where it serves, what fine-tuning it takes).
    """

    kv_notes: list[str] = field(default_factory=list)
    params: tuple[dict, str] | None = None
    usage_notes: list[str] = field(default_factory=list)


def method_sections(reports: dict[str, dict | None]) -> MethodSections:
    """Every registered card hook's part, merged in registry order. Each hook is asked about every card
    and reads the reports itself, so it speaks only when its part is in the folder: a composite's report
    carries each earlier step under that step's name, and a healed folder keeps the conversion report."""
    merged = MethodSections()
    for spec in dict.fromkeys(m.card for m in registry.methods().values() if m.card):
        part = registry.load(spec)(reports)
        merged.kv_notes += part.kv_notes
        merged.params = merged.params or part.params
        merged.usage_notes += part.usage_notes
    return merged


def method_title(method: str) -> str:
    """The registered method's words for the attention it writes; an unknown name (a report from a
    newer attnkit) as itself."""
    known = registry.methods().get(method)
    return known.title if known else method
