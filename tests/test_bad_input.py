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
from conftest import refused_in_one_line, tree_digest  # noqa: E402


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("bad") / "src", "llama")


@pytest.mark.parametrize("to", ["mla", "dex", "diff", "gqa", "titans", "mla+dex", "mla+titans"])
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


# ---------------------------------------------------------------- every other command that writes a folder or file


def _copy(folder: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(folder, to)
    return to


@pytest.mark.parametrize("who", ["student", "teacher"])
@pytest.mark.parametrize("where", ["same", "parent"])
def test_finetune_output_on_the_student_or_teacher_is_refused_even_forced(tmp_path, capsys, where, who):
    from test_finetune_fixtures import base_recipe, build_tokenizer, save_deepseek, save_llama, write_corpus, write_recipe

    corpus = write_corpus(tmp_path / "c.jsonl")
    tok = build_tokenizer(corpus)
    student = save_deepseek(tmp_path / "s" / "student", tok)
    teacher = save_llama(tmp_path / "t" / "teacher", tok)
    target = {"student": student, "teacher": teacher}[who]
    before = tree_digest(target.parent)
    out = target if where == "same" else target.parent
    path = write_recipe(tmp_path / "r.yaml", **{**base_recipe(tmp_path, student, teacher, corpus), "output_dir": str(out)})
    err = refused_in_one_line(lambda: main(["finetune", "--config", str(path), "force=true"]), capsys,
                              tmp_path / "nothing", {"student": "the source model", "teacher": "the teacher"}[who],
                              str(target.resolve()))
    assert "--force" not in err and tree_digest(target.parent) == before
    assert not Path(str(out) + ".run").exists() and not list(tmp_path.glob(".*attnkit-tmp*"))


def test_finetune_says_which_teacher_it_loaded(tmp_path, capsys):
    from test_finetune_fixtures import build_tokenizer, save_llama, write_corpus

    from attnkit.training.teacher import load_teacher

    teacher = save_llama(tmp_path / "teacher", build_tokenizer(write_corpus(tmp_path / "c.jsonl")))
    assert load_teacher(teacher, {}, "cpu") is not None
    assert f"teacher loaded from {teacher}" in capsys.readouterr().err


def _pretrain_recipe(tmp_path: Path, run_dir: Path, export_dir: Path, corpus: Path) -> Path:
    import yaml

    corpus.mkdir(parents=True, exist_ok=True)
    (corpus / "a.py").write_text("def f(x):\n    return x\n" * 20)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(run_dir), "export_dir": str(export_dir), "corpus": str(corpus)}))
    return path


@pytest.mark.parametrize("where, what", [("run_dir", "is the run folder"), ("parent_of_run", "contains the run folder"),
                                         ("parent_of_corpus", "contains the corpus")])
def test_pretrain_export_on_its_run_folder_or_corpus_is_refused_before_training(tmp_path, capsys, where, what):
    export = tmp_path / "exp"
    run_dir = {"run_dir": export, "parent_of_run": export / "run"}.get(where, tmp_path / "run")
    corpus = export / "corpus" if where == "parent_of_corpus" else tmp_path / "corpus"
    path = _pretrain_recipe(tmp_path, run_dir, export, corpus)
    before = tree_digest(tmp_path)
    refused_in_one_line(lambda: main(["pretrain", "--config", str(path)]), capsys, run_dir / "recipe.json", what)
    assert tree_digest(tmp_path) == before and not run_dir.exists()


def test_pretrain_card_names_a_local_corpus_by_its_folder():
    from attnkit.training.pretrain import PretrainRecipe, _card

    summary = {"params": 1, "steps": 1, "tokens_seen": 1, "train_tokens_available": 1, "device": "cpu", "seconds": 60,
               "validation_tokens": 1, "validation_loss": 1.0, "validation_perplexity": 2.7,
               "validation_perplexity_1024": 2.7}
    card = _card(PretrainRecipe(corpus="/home/u/texts", run_dir="/home/u/runs/x", export_dir="/home/u/out"), summary)
    assert "/home/u" not in card and "Corpus: `texts`" in card


@pytest.mark.parametrize("command", ["eval", "bench"])
def test_eval_and_bench_out_on_a_model_file_is_refused(tmp_path, src, capsys, command):
    model = _copy(src, tmp_path / "m")
    before = tree_digest(model)
    extra = ["--context", "16", "--decode-tokens", "2", "--repeats", "1"] if command == "bench" else ["--limit", "1"]
    for name in ("config.json", "model.safetensors")[: 2 if command == "eval" else 1]:  # bench: .json only anyway
        argv = [command, str(model), "--out", str(model / name), *extra]
        refused_in_one_line(lambda: main(argv), capsys, tmp_path / "nothing", f"--out {model / name} exists",
                            f"attnkit {command}")
    assert tree_digest(model) == before
