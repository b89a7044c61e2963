"""What the engine harnesses under benchmarks/engines/ share (llama_cpp.py, vllm_cpu.py).

Standard library only: vllm_cpu.py also runs in the vLLM venv (its child process), where attnkit
is not installed. The scripts load this file by its path (see ``load_common`` in each), so it needs
no package and no entry on sys.path.
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PPL_DATA = REPO / "attnkit" / "evaluation" / "tasks" / "data" / "ppl.jsonl"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_text(data: str) -> tuple[str, str]:
    """(text, description). 'ppl': the documents of the bundled lm-eval perplexity task, joined by a
    blank line. 'validation': attnkit.data's validation split of the Python corpus (first ~400 KB).
    Otherwise a path to a text file or a .jsonl with a 'text' field."""
    if data == "ppl":
        rows = [json.loads(ln) for ln in PPL_DATA.read_text().splitlines() if ln.strip()]
        text = "\n\n".join(r["text"] for r in rows)
        desc = f"{PPL_DATA.relative_to(REPO)} ({len(rows)} documents joined by a blank line)"
    elif data == "validation":
        sys.path.insert(0, str(REPO))
        from attnkit.data import iter_documents  # noqa: PLC0415

        parts, size = [], 0
        for doc in iter_documents("python", "validation"):
            parts.append(doc.text)
            size += len(doc.text)
            if size > 400_000:
                break
        text = "\n\n".join(parts)
        desc = f"attnkit.data validation split, first {len(parts)} documents"
    else:
        p = Path(data)
        if p.suffix == ".jsonl":
            rows = [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]
            text = "\n\n".join(r["text"] for r in rows)
        else:
            text = p.read_text()
        desc = str(p)
    # llama-perplexity's -f drops one trailing newline; llama-tokenize keeps it: give them none.
    return text.rstrip("\n"), desc


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return None
    return a / b


# wrappers that re-raise another error: the line naming the cause comes before them
_GENERIC_ERRORS = (
    "Engine core initialization failed",
    "See root cause above",
    "Failed core proc(s)",
)


def python_error_line(text: str) -> str:
    """The 'Type: message' line of a Python traceback (its last such line, skipping wrappers that
    only say "see the cause above"), never the traceback."""
    # vLLM prefixes a worker's traceback lines with '[rank0]: '
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", ln.rstrip()) for ln in text.splitlines() if ln.strip()]
    errors = [ln.strip() for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", ln)]
    specific = [ln for ln in errors if not any(g in ln for g in _GENERIC_ERRORS)]
    if specific or errors:
        line = (specific or errors)[-1]
        # pydantic puts the reason on the next line: "1 validation error for ModelConfig\n  Value error, ..."
        if re.search(r"\d+ validation errors? for \w+$", line):
            i = max(i for i, ln in enumerate(lines) if ln.strip() == line)
            if i + 1 < len(lines):
                detail = lines[i + 1].strip()
                line += ": " + (detail if len(detail) <= 300 else detail[:300] + " ...")
        return line
    for ln in reversed(lines):
        if "ERROR" in ln or "error" in ln:
            return ln.strip()
    return lines[-1].strip() if lines else "no output"


def fmt(v, spec=".4f") -> str:
    return "-" if v is None else format(v, spec)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub table: the header, a '|---|' rule, one line per row ('|' inside a cell escaped)."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(out)
