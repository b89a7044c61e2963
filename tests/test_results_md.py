"""docs/results.md's generated tables are what benchmarks/results_md.py writes from the recorded JSON files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "results_md.py"


def test_results_md_is_up_to_date():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr + "\nrun: python benchmarks/results_md.py"


def test_check_fails_on_a_stale_page(tmp_path):
    page = tmp_path / "results.md"
    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    begin = "<!-- results_md: qknorm-fold-bound -->"
    assert begin in text
    page.write_text(text.replace(begin, begin + "\n| a stale row |"), encoding="utf-8")
    check = [sys.executable, str(SCRIPT), "--check", "--page", str(page)]
    assert subprocess.run(check, cwd=ROOT, capture_output=True, timeout=60).returncode == 1
    # writing it makes it current, and a second write changes nothing
    subprocess.run([sys.executable, str(SCRIPT), "--page", str(page)], cwd=ROOT, check=True, timeout=60)
    assert page.read_text(encoding="utf-8") == text
    assert subprocess.run(check, cwd=ROOT, capture_output=True, timeout=60).returncode == 0
