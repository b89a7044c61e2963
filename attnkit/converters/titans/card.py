"""What the model card says that only Titans knows (`Method.card`, read by attnkit/card/hooks.py): its
state stops growing at the window, which the per-token KV figure does not tell. Asked about every card:
it speaks only when the conversion report has a `titans` section with the measured state."""

from __future__ import annotations

from attnkit.card.hooks import MethodSections


def card_sections(reports: dict[str, dict | None]) -> MethodSections:
    """The bounded-state sentence under the KV-cache table (`titans`, `mla+titans`)."""
    titans = (reports.get("convert") or {}).get("titans")
    if not (isinstance(titans, dict) and "state_bytes" in titans):
        return MethodSections()
    from attnkit.evaluation.kv import bounded_state_note

    return MethodSections(kv_notes=[f"The state is {bounded_state_note(titans)}."])
