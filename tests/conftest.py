import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hashlib
import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import calib_folder  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(relative: str, name: str):
    """A script under benchmarks/ imported as a module (they are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under `folder`: relative path -> sha256 of its bytes (a folder left untouched has the same)."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def refused_in_one_line(run, capsys, out: Path, *words: str) -> str:
    """`run()` is bad input: exit 2, one line on stderr naming every one of `words`, nothing at `out`.
    Returns the line."""
    capsys.readouterr()
    assert run() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for w in words:
        assert w in err[0], (w, err[0])
    assert not Path(out).exists()
    return err[0]


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    """A calibration text folder (mla_fixtures.calib_folder) shared by a test module."""
    return calib_folder(tmp_path_factory.mktemp("calib"))
