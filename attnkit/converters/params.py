"""Parameter counts of a conversion's source and output, by part, from the checkpoints' headers (no
tensor is read): a conversion that shrinks the KV cache may grow the weights, and the report and the
model card say by how much and why (`why`, written by each method)."""

from __future__ import annotations

import math
import re

PARTS = [  # (part, tensor-name pattern); the first that matches takes a tensor
    ("embeddings", re.compile(r"embed_tokens\.")),
    ("LM head", re.compile(r"(^|\.)lm_head\.")),
    ("queries", re.compile(r"self_attn\.q_(proj|a_proj|a_layernorm|b_proj)\.")),
    ("keys and values", re.compile(r"self_attn\.(k_proj|v_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj)\.")),
    ("attention output", re.compile(r"self_attn\.o_proj\.")),
    ("MLP", re.compile(r"\.mlp\.")),
]
OTHER = "other (norms, method modules)"


def counts_by_part(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """part -> parameters, over a checkpoint's tensor shapes (a tied LM head is not stored: 0)."""
    out = {part: 0 for part, _ in PARTS}
    out[OTHER] = 0
    for name, shape in shapes.items():
        part = next((p for p, pattern in PARTS if pattern.search(name)), OTHER)
        out[part] += math.prod(shape)
    return out


def parameter_report(before: dict[str, tuple[int, ...]], after: dict[str, tuple[int, ...]],
                     why: dict[str, tuple[str, str]] | None = None) -> dict:
    """{"before", "after", "ratio", "by_part": {part: {"before", "after", "why"?, "short"?}}} for the
    parts that are not empty; `why`: part -> (a few words for the printout, the reason in full), kept
    only where the part did change."""
    b, a = counts_by_part(before), counts_by_part(after)
    parts = {}
    for part in b:
        if b[part] or a[part]:
            entry = {"before": b[part], "after": a[part]}
            if b[part] != a[part] and (why or {}).get(part):
                entry["short"], entry["why"] = why[part]
            parts[part] = entry
    total_b, total_a = sum(b.values()), sum(a.values())
    return {"before": total_b, "after": total_a, "ratio": round(total_a / total_b, 4) if total_b else None,
            "by_part": parts}


def format_params(params: dict) -> list[str]:
    """The printout: the totals, then each part that changed with its reason in a few words (the
    report and the model card give it in full)."""
    lines = [f"parameters: {params['before']:,} -> {params['after']:,} (x{params['ratio']:.3f})"]
    for part, entry in params["by_part"].items():
        change = entry["after"] - entry["before"]
        if change:
            reason = f" ({entry['short']})" if entry.get("short") else ""
            lines.append(f"  {part} {change:+,}{reason}")
    return lines
