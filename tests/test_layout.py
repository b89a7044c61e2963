"""The package's layering, checked from the source text (no imports run):

- `attnkit.io` (checkpoint I/O) and `attnkit.card` (the model card) serve every method and import nothing
  from `attnkit.converters` (a method's card sections reach the card through the registry);
- no module imports another module's private (`_name`) names, directly or as `module._name`;
- module-level imports between attnkit modules form no cycle;
- the modeling code copied into converted checkpoints (`auto_map`) imports no attnkit module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import attnkit

ROOT = Path(attnkit.__file__).resolve().parent
REMOTE_CODE = ("adapters/modeling_attnkit.py", "adapters/dex.py", "adapters/diff.py", "adapters/families.py")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    is_package = MODULES[module].name == "__init__.py"
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, top_level_only: bool = False):
    """(imported module, imported name or None, node) for every attnkit import in `module`."""
    tree = ast.parse(MODULES[module].read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("attnkit"):
                    yield alias.name, None, alias
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if target.startswith("attnkit"):
                for alias in node.names:
                    yield target, alias.name, alias


@pytest.mark.parametrize("package", ["attnkit.io", "attnkit.card"])
def test_io_and_card_import_nothing_from_converters(package):
    bad = [(m, t) for m in MODULES if m == package or m.startswith(package + ".") for t, _, _ in _imports(m)
           if t.startswith("attnkit.converters")]
    assert not bad, bad


def test_no_private_names_cross_modules():
    bad = []
    for module in MODULES:
        aliases = set()
        for target, name, alias in _imports(module):
            if name is not None and name.startswith("_") and not name.startswith("__"):
                bad.append((module, f"{target}.{name}"))
            full = target if name is None else f"{target}.{name}"
            if full in MODULES:  # a module bound to a local name
                aliases.add(alias.asname or (full if name is None else name))
        for node in ast.walk(ast.parse(MODULES[module].read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append((module, f"{node.value.id}.{node.attr}"))
    assert not bad, bad


def test_module_level_imports_have_no_cycle():
    graph = {}
    for module in MODULES:
        deps = set()
        for target, name, _ in _imports(module, top_level_only=True):
            full = f"{target}.{name}" if name and f"{target}.{name}" in MODULES else target
            if full in MODULES and full != module:
                deps.add(full)
        graph[module] = deps
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in graph[m]:
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep):] + [m, dep]))
            if dep not in state:
                visit(dep, path + [m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_remote_code_imports_no_attnkit():
    for rel in REMOTE_CODE:
        module = ".".join(("attnkit", *Path(rel).with_suffix("").parts))
        absolute = [t for t, _, _ in _imports(module) if not t.startswith("attnkit.adapters")]
        tree = ast.parse((ROOT / rel).read_text())
        plain = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names if a.name.startswith("attnkit")]
        froms = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level
                 and (n.module or "").startswith("attnkit")]
        assert not absolute and not plain and not froms, (rel, absolute, plain, froms)
