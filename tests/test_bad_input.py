"""Bad input from issue "The first hour": one line, exit 2, nothing written, the source untouched."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit.cli import main
from attnkit.io.checkpoint import atomic_output_dir

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import save_model  # noqa: E402
from conftest import tree_digest  # noqa: E402


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("bad") / "src", "llama")


@pytest.mark.parametrize("to", ["mla", "dex"])
@pytest.mark.parametrize("where", ["same", "inside", "parent", "symlink"])
def test_output_on_the_source_is_refused_whatever_the_flags(tmp_path, src, capsys, to, where):
    before = tree_digest(src)
    out = {"same": src, "inside": src / "out", "parent": src.parent}.get(where)
    if where == "symlink":
        out = tmp_path / "link"
        out.symlink_to(src)
    for force in ([], ["--force"]):
        capsys.readouterr()
        assert main(["convert", "--to", to, str(out), "-o", str(out), *force] if where == "symlink" else
                    ["convert", "--to", to, str(src), "-o", str(out), *force]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "source model" in err[0] and "--force" not in err[0]
    assert tree_digest(src) == before and not (src / "out").exists()


def test_bad_context_list_is_one_line():
    run = subprocess.run([sys.executable, "-m", "attnkit.cli", "bench", "reference", "--context", ","],
                         capture_output=True, text=True)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and "--context" in run.stderr


def test_stale_scratch_of_a_dead_run_is_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".o.attnkit-tmp-{dead.pid}-0123abcd"
    (stale / "sub").mkdir(parents=True)
    live = tmp_path / f".o.attnkit-tmp-{os.getpid()}-0123abcd"
    live.mkdir()
    with atomic_output_dir(tmp_path / "o") as tmp:
        (tmp / "x").write_text("1")
    assert not stale.exists() and live.exists() and (tmp_path / "o" / "x").is_file()


def test_reference_beside_a_reference_folder_says_which_is_used(tmp_path, monkeypatch, capsys):
    from attnkit.io.resolve import REFERENCE_DIR, resolve_model

    (tmp_path / "reference").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("reference") == REFERENCE_DIR
    err = capsys.readouterr().err
    assert "bundled model" in err and "./reference" in err
    monkeypatch.chdir(REFERENCE_DIR.parent.parent)  # no ./reference folder here: nothing said
    resolve_model("reference")
    assert capsys.readouterr().err == ""
