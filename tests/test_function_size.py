"""No function or method in `attnkit/` is longer than 80 lines (from its `def` line to its last line, the
decorators not counted), checked from the source text: a longer one is several stages that want names."""

from __future__ import annotations

import ast
from pathlib import Path

import attnkit

ROOT = Path(attnkit.__file__).resolve().parent
MAX_LINES = 80


def _long_functions() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):  # module functions, methods and nested functions alike
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    rel = path.relative_to(ROOT.parent).as_posix()
                    found.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_function_over_80_lines():
    long = _long_functions()
    assert not long, f"functions over {MAX_LINES} lines (split them into named stages):\n" + "\n".join(long)
