"""README.md stays readable (issue 30): a capability table of at most 12 rows of at most 200 characters,
and no word in README.md or docs/*.md of tools that users do not have."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_ROWS, MAX_ROW_CHARS = 12, 200
FORBIDDEN = ("farm-bench", "farm-studio", "duplicates", "this session")


def capability_table() -> list[str]:
    """The rows of the table under README's '## What it does' (header and separator excluded)."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## What it does\n", 1)
    assert len(section) == 2, "README.md has no '## What it does' section"
    lines = section[1].split("\n## ", 1)[0].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line)
    assert len(table) >= 3 and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", table[1]), table[:2]
    return table[2:]


def test_capability_table_is_short():
    rows = capability_table()
    assert 1 <= len(rows) <= MAX_ROWS, f"{len(rows)} rows (at most {MAX_ROWS}): move details to docs/results.md"
    long = [(len(row), row[:80]) for row in rows if len(row) > MAX_ROW_CHARS]
    assert not long, f"rows over {MAX_ROW_CHARS} characters: {long}"


def test_readme_has_one_table():
    text = re.sub(r"^```.*?^```", "", README.read_text(encoding="utf-8"), flags=re.S | re.M)
    separators = [line for line in text.splitlines() if re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line)]
    assert len(separators) == 1, "README.md: one table (the capability table); figures go to docs/results.md"


def test_no_tools_users_do_not_have():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    found = []
    for page in pages:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for word in FORBIDDEN:
                if word in line.lower():
                    found.append(f"{page.relative_to(ROOT)}:{number}: {word}")
    assert not found, "\n".join(found)


def test_readme_links_results_and_changelog():
    text = README.read_text(encoding="utf-8")
    assert "docs/results.md" in text and "CHANGELOG.md" in text
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    assert "results.md" in index and "CHANGELOG.md" in index
