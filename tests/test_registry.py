"""The method registry (`attnkit/registry.py`): every `--to` is declared once, in its own folder, and
the CLI, the dispatcher, the printout and the model card read it. A method in a new folder appears
everywhere with no other edit."""

from __future__ import annotations

import ast
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

import attnkit
import attnkit.converters
from attnkit import registry
from attnkit.cli import build_parser, main as cli_main
from attnkit.card.build import build_card

ROOT = Path(attnkit.__file__).resolve().parent
# the modeling code copied into checkpoints reads the method from the checkpoint's config and runs
# without attnkit installed, so it cannot read the registry (tests/test_layout.py: REMOTE_CODE)
SELF_CONTAINED = ROOT / "adapters"
# serve every method and name none: a method's words in the card come from its folder's card hook
NAMELESS = (ROOT / "card", ROOT / "io")


def _convert_choices() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    convert = sub.choices["convert"]
    return list(next(a for a in convert._actions if a.dest == "to").choices)


def test_cli_choices_are_the_registry():
    assert _convert_choices() == list(registry.methods())
    assert {"mla", "dex", "diff", "mla+dex", "titans", "mla+titans", "gqa"} <= set(registry.methods())


def test_every_converter_folder_registers_its_methods():
    folders = [p.parent.name for p in (ROOT / "converters").glob("*/convert.py")]
    declared = {m.converter.split(".")[2] for m in registry.methods().values()}
    assert sorted(folders) == sorted(declared)
    for method in registry.methods().values():
        assert callable(registry.load(method.converter)), method.name


@pytest.mark.parametrize("name", list(registry.methods()))
def test_model_card_names_every_method(name):
    card = str(build_card({"convert": {"method": name, "source": {"model": "org/src"}}, "finetune": None,
                           "eval": None, "config": None}))
    assert registry.get(name).title in card


def _method_literals(node: ast.AST, names: set[str]) -> list[str]:
    if isinstance(node, ast.Constant) and node.value in names:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
    return []


def _mentions_method(node: ast.AST) -> bool:
    """An operand that is the method: `args.to`, `method`, `spec["method"]`, `x.get("method")` ..."""
    text = ast.unparse(node)
    return any(word in text for word in ("method", ".to", "'to'"))


def test_no_dispatch_on_method_names_outside_their_folders():
    """No `if method == "dex"` / `args.to in ("dex", ...)` chains and no `{"dex": ..., "diff": ...}` tables
    outside the methods' own folders: they iterate the registry."""
    names = set(registry.methods())
    own = {ROOT / "converters" / m.converter.split(".")[2] for m in registry.methods().values()}
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if any(d in path.parents for d in own) or SELF_CONTAINED in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                hits = [h for n in operands for h in _method_literals(n, names)]
                if hits and any(_mentions_method(n) for n in operands):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {hits}")
            elif isinstance(node, ast.Dict):
                keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in names]
                if len(keys) >= 2:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {keys}")
    assert not found, found


def test_the_card_and_io_name_no_method():
    """Not in code, strings, docstrings or comments: MLA's serving advice or Titans' state note written
    here would be a method's knowledge outside its folder (they are `converters/<method>/card.py`)."""
    words = sorted({w for name in registry.methods() for w in name.split("+")})
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, words)) + r")(?![\w-])", re.IGNORECASE)
    found = [f"{path.relative_to(ROOT)}:{n} {match.group(0)}" for folder in NAMELESS for path in sorted(folder.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) for match in pattern.finditer(line)]
    assert not found, found


def test_card_sections_come_from_the_method_folders():
    """A plain MLA output's card serves from mla/card.py, a Titans output's state note from titans/card.py;
    a method without a hook adds nothing."""
    hooks = {m.name: m.card for m in registry.methods().values()}
    assert hooks["mla"] == "attnkit.converters.mla.card:card_sections"
    assert hooks["titans"] == hooks["mla+titans"] == "attnkit.converters.titans.card:card_sections"
    kv = {"before": 100, "after": 50}
    state = {"window": 64, "memory_depth": 1, "state_bytes": {"contexts": [64], "bytes": [10]}}
    titans = str(build_card({"convert": {"method": "titans", "kv_cache_bytes_per_token": kv, "titans": state},
                             "finetune": None, "eval": None, "config": None}))
    assert "The state is bounded: the last 63 tokens'" in titans and "Serving:" not in titans
    mla = str(build_card({"convert": {"method": "mla", "kv_cache_bytes_per_token": kv}, "finetune": None, "eval": None,
                          "config": {"model_type": "deepseek_v3"}}))
    assert "Serving: **transformers only**" in mla and "The state is" not in mla


def test_an_option_of_another_method_is_refused(capsys):
    assert cli_main(["convert", "--to", "mla", "reference", "-o", "unused", "--window", "64"]) == 2
    assert "--window applies to --to titans and --to mla+titans, not --to mla" in capsys.readouterr().err
    assert cli_main(["convert", "--to", "gqa", "reference", "-o", "unused", "--heads", "all"]) == 2
    assert "--heads applies to --to dex and --to mla+dex, not --to gqa" in capsys.readouterr().err


NEW_METHOD = {
    "__init__.py": '''
        from attnkit.registry import Method
        from attnkit.converters.cla.config import CLAConfig

        METHODS = (Method("cla", title="cross-layer attention (test)", help="share KV across layers (test)",
                          converter="attnkit.converters.cla.convert:convert", configs=(CLAConfig,), order=70),)
        ''',
    "config.py": '''
        from dataclasses import dataclass
        from typing import ClassVar

        from attnkit.options import option


        @dataclass
        class CLAConfig:
            GROUP: ClassVar[str | None] = "CLA (--to cla)"
            share: int = option(2, "layers that share one KV cache", metavar="N")

            def check(self):
                from attnkit.errors import AttnkitError

                if self.share < 1:
                    raise AttnkitError(f"--share must be at least 1, got {self.share}")
        ''',
    "convert.py": '''
        import json
        from pathlib import Path

        from attnkit.io.checkpoint import atomic_output_dir


        def convert(args):
            with atomic_output_dir(args.out, args.force, ()) as tmp:
                (tmp / "attnkit_report.json").write_text(json.dumps({"method": "cla", "share": args.share}))
            return 0
        ''',
}


@pytest.fixture
def new_method_folder(tmp_path, monkeypatch):
    """A method added as one new folder (here outside the tree, on the converters package's path)."""
    folder = tmp_path / "cla"
    folder.mkdir()
    for name, text in NEW_METHOD.items():
        (folder / name).write_text(textwrap.dedent(text))
    monkeypatch.setattr(attnkit.converters, "__path__", [*attnkit.converters.__path__, str(tmp_path)])
    registry.methods.cache_clear()
    yield
    registry.methods.cache_clear()
    for mod in [m for m in sys.modules if m.startswith("attnkit.converters.cla")]:
        del sys.modules[mod]


def test_a_new_folder_is_a_new_method(new_method_folder, tmp_path, capsys, monkeypatch):
    assert "cla" in _convert_choices()
    monkeypatch.setattr("attnkit.io.checkpoint.check_finite", lambda *a, **k: None)
    out = tmp_path / "out"
    assert cli_main(["convert", "--to", "cla", "reference", "-o", str(out), "--share", "3"]) == 0
    assert json.loads((out / "attnkit_report.json").read_text()) == {"method": "cla", "share": 3}
    assert cli_main(["convert", "--to", "cla", "reference", "-o", str(tmp_path / "o2"), "--share", "0"]) == 2
    assert "--share must be at least 1, got 0" in capsys.readouterr().err
    assert cli_main(["convert", "--to", "mla", "reference", "-o", str(tmp_path / "o3"), "--share", "3"]) == 2
    assert "--share applies to --to cla, not --to mla" in capsys.readouterr().err
    report = attnkit.convert("reference", to="cla", out=tmp_path / "o4", config=registry.get("cla").configs[0](share=4))
    assert report["share"] == 4
    card = str(build_card({"convert": {"method": "cla"}, "finetune": None, "eval": None, "config": None}))
    assert "cross-layer attention (test)" in card
