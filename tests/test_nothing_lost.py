"""Issue "Nothing lost, nothing leaked": concurrent writers, non-finite weights, arguments checked
before any work, no local paths in reports. Bad input: one line on stderr, exit 2, nothing written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnkit.cli import main
from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import atomic_output_dir, claim_output, lock_path

sys.path.insert(0, str(Path(__file__).parent))
from conftest import refused_in_one_line, tree_digest  # noqa: E402
from mla_fixtures import save_model  # noqa: E402
from test_finetune_fixtures import tiny  # noqa: E402,F401


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("lost") / "src", "llama")


def _with_bad_weight(src: Path, to: Path, value: float) -> Path:
    import shutil

    shutil.copytree(src, to)
    weights = load_file(to / "model.safetensors")
    weights["model.layers.1.self_attn.k_proj.weight"][0, 3] = value
    save_file(weights, to / "model.safetensors", metadata={"format": "pt"})
    return to


HOLD = "import sys, time\nfrom attnkit.io.checkpoint import claim_output\nwith claim_output(sys.argv[1]):\n" \
       "    print('held', flush=True)\n    time.sleep(120)\n"


# ---------------------------------------------------------------- 1. one writer per OUT


def test_second_writer_of_the_same_out_is_refused_and_the_first_result_stays(tmp_path, src, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = refused_in_one_line(lambda: main(["convert", "--to", "mla", str(src), "-o", str(out)]), capsys, out,
                                   "being written by another attnkit process", f"pid {holder.pid}")
        assert "Traceback" not in line
        with pytest.raises(AttnkitError, match="being written"):  # the finetune/export path
            with atomic_output_dir(out):
                pass
    finally:
        holder.kill()
        holder.wait()
    # a killed holder's lock is free at once (the kernel's lock, whatever its file still says)
    with atomic_output_dir(out) as tmp:
        (tmp / "x").write_text("1")
    assert (out / "x").read_text() == "1" and not lock_path(out).exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_out_that_appeared_meanwhile_is_not_replaced(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(AttnkitError, match="appeared while this run was writing it"):
        with atomic_output_dir(out) as tmp:
            (tmp / "mine").write_text("second")
            out.mkdir()
            (out / "first").write_text("first")
    assert [p.name for p in out.iterdir()] == ["first"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with atomic_output_dir(out, force=True) as tmp:  # --force replaces it, as before
        (tmp / "mine").write_text("second")
    assert [p.name for p in out.iterdir()] == ["mine"]


def test_claim_is_reentrant_and_removes_the_parents_it_created(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with claim_output(out):
        with claim_output(out / ".." / "out"):
            assert lock_path(out).is_file() and lock_path(out).read_text().strip() == str(os.getpid())
    assert not (tmp_path / "a").exists()


def test_unwritable_output_parent_is_one_line(tmp_path, src, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    refused_in_one_line(lambda: main(["convert", "--to", "mla", str(src), "-o", str(blocker / "out")]), capsys,
                        blocker / "out", "cannot write", "is a file, not a folder")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            refused_in_one_line(lambda: main(["convert", "--to", "mla", str(src), "-o", str(ro / "out")]), capsys,
                                ro / "out", "not writable")
        finally:
            ro.chmod(0o755)


# ---------------------------------------------------------------- 2. NaN / Inf weights


@pytest.mark.parametrize("value,word", [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_non_finite_weights_are_refused_by_eval_convert_and_push(tmp_path, src, capsys, value, word):
    bad = _with_bad_weight(src, tmp_path / "bad", value)
    before = tree_digest(bad)
    name = "model.layers.1.self_attn.k_proj.weight"
    refused_in_one_line(lambda: main(["eval", str(bad), "--limit", "1", "--out", str(tmp_path / "r.json")]), capsys,
                        tmp_path / "r.json", "non-finite", name, word)
    refused_in_one_line(lambda: main(["eval", str(src), "--baseline", str(bad), "--limit", "1"]), capsys,
                        tmp_path / "nothing", name)
    for to in ("mla", "dex"):
        refused_in_one_line(lambda: main(["convert", "--to", to, str(bad), "-o", str(tmp_path / "o")]), capsys,
                            tmp_path / "o", "non-finite", name)
    refused_in_one_line(lambda: main(["push", str(bad), "--repo-id", "alice/bad", "--token", "x",
                                      "--endpoint", "http://127.0.0.1:9"]), capsys, tmp_path / "nothing", name)
    assert tree_digest(bad) == before


def test_finite_scan_reads_every_shard(tmp_path):
    from attnkit.io.checkpoint import ShardedWriter, first_non_finite

    writer = ShardedWriter(tmp_path / "m", max_shard_bytes=64)
    for i in range(4):
        writer.add(f"w{i}", torch.ones(8) if i < 3 else torch.tensor([1.0, float("-inf")]))
    writer.add("ids", torch.arange(3))
    writer.close()
    assert first_non_finite(tmp_path / "m") == ("w3", "Inf")


# ---------------------------------------------------------------- 3. arguments checked before any work


@pytest.mark.parametrize("argv,words", [
    (["eval", "reference", "--limit", "0"], ["--limit", "positive"]),
    (["eval", "reference", "--limit", "-3"], ["--limit", "-3"]),
    (["eval", "reference", "--batch-size", "0"], ["--batch-size", "at least 1"]),
    (["bench", "reference", "--threads", "0"], ["--threads", "at least 1"]),
    (["bench", "reference", "--prefill-chunk", "-1"], ["--prefill-chunk", "-1"]),
    (["convert", "--to", "mla", "reference", "-o", "OUT", "--heads", "0.5"], ["--heads", "--to dex"]),
    (["convert", "--to", "gqa", "reference", "-o", "OUT", "--heads-fraction", "0.3"], ["--heads-fraction"]),
    (["convert", "--to", "mla", "reference", "-o", "OUT", "--eval", "--limit", "0"], ["--limit", "positive"]),
    (["convert", "--to", "mla", "reference", "-o", "OUT", "--limit", "4"], ["--limit", "--eval"]),
])
def test_bad_numbers_are_one_line(tmp_path, capsys, argv, words):
    argv = [str(tmp_path / "o") if a == "OUT" else a for a in argv]
    refused_in_one_line(lambda: main(argv), capsys, tmp_path / "o", *words)


@pytest.mark.parametrize("command", ["eval", "bench"])
def test_unwritable_out_file_is_refused_before_loading(tmp_path, capsys, monkeypatch, command):
    import attnkit.evaluation.score as score

    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setattr(score, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    refused_in_one_line(lambda: main([command, "reference", "--out", str(blocker / "r.json")]), capsys,
                        blocker / "r.json", "cannot be written", "is a file, not a folder")


# ---------------------------------------------------------------- 5. convert's messages


def test_source_without_tokenizer_says_so_whole(tmp_path, src, capsys):
    import shutil

    notok = tmp_path / "notok"
    notok.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, notok / name)
    line = refused_in_one_line(lambda: main(["convert", "--to", "mla", str(notok), "-o", str(tmp_path / "o")]),
                               capsys, tmp_path / "o", "tokenizer", "no tokenizer files", "tokenizer.json", "copy")
    assert not line.rstrip().endswith(":")


def test_missing_calib_file_says_it_does_not_exist(tmp_path, src, capsys):
    refused_in_one_line(lambda: main(["convert", "--to", "dex", str(src), "-o", str(tmp_path / "o"),
                                      "--calib", str(tmp_path / "nope.txt")]), capsys, tmp_path / "o",
                        "nope.txt", "no such file or folder")


def test_unknown_eval_task_is_refused_before_converting(tmp_path, src, capsys, monkeypatch):
    import attnkit.converters.run as run

    monkeypatch.setattr(run, "load_handler", lambda *a: pytest.fail("converted"))
    refused_in_one_line(lambda: main(["convert", "--to", "mla", str(src), "-o", str(tmp_path / "o"), "--eval",
                                      "--tasks", "attnkit-quick,no-such-task"]), capsys, tmp_path / "o",
                        "unknown task 'no-such-task'")


# ---------------------------------------------------------------- 4. no absolute local paths in reports


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def _absolute_in_reports(folder: Path) -> list[str]:
    return [f"{p.name}: {s}" for p in sorted(folder.glob("*.json")) if not p.name.startswith(("tokenizer", "."))
            for s in _strings(json.loads(p.read_text())) if s.startswith(("/", "~"))]


def test_convert_and_eval_reports_carry_no_absolute_paths(tmp_path, src, calib):
    from types import SimpleNamespace

    from attnkit.io.public import LOCAL_FILE
    from attnkit.training.teacher import teacher_spec

    out = tmp_path / "out"
    assert main(["convert", "--to", "mla", str(src.resolve()), "-o", str(out.resolve()), "--calib", str(calib.resolve()),
                 "--calib-tokens", "1024", "--eval-tokens", "512", "--calib-seq-len", "256", "--report", "final",
                 "--eval", "--tasks", "attnkit-ppl-quick"]) == 0
    assert (out / "eval_results.json").is_file() and _absolute_in_reports(out) == []
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["source"]["path"] == src.name  # outside the working directory: by its name
    # ... while this machine still knows where it is (never uploaded): `teacher: source` finds it
    assert json.loads((out / LOCAL_FILE).read_text())["attnkit_report.json"]["source.path"] == str(src.resolve())
    assert teacher_spec(SimpleNamespace(teacher="source"), out) == str(src.resolve())
    from attnkit.io.hub import upload_files

    assert LOCAL_FILE not in upload_files(out)


def test_eval_of_the_bundled_reference_names_it_by_its_word(tmp_path):
    out = tmp_path / "r.json"
    assert main(["eval", "reference", "--tasks", "attnkit-ppl-quick", "--limit", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["models"]["model"]["path"] == "reference" and [s for s in _strings(result) if s.startswith("/")] == []


def test_public_paths_relative_to_the_output_under_the_working_directory(tmp_path, monkeypatch):
    from attnkit.io.public import public_model, public_path
    from attnkit.io.resolve import REFERENCE_DIR

    (tmp_path / "models" / "src").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out" / "x"
    assert public_path(tmp_path / "models" / "src", out) == "../../models/src"
    assert public_path("models/src", out) == "../../models/src"
    assert public_path("/elsewhere/my-llama", out) == "my-llama"
    assert public_path(REFERENCE_DIR, out) == "reference"
    hub = "/root/.cache/huggingface/hub/models--meta-llama--Llama-3.2-1B/snapshots/abc"
    assert public_path(hub, out) == "models--meta-llama--Llama-3.2-1B/snapshots/abc"
    assert public_model("meta-llama/Llama-3.2-1B", hub, out) == ("meta-llama/Llama-3.2-1B", "models--meta-llama--Llama-3.2-1B/snapshots/abc")
    # a local folder shaped like a Hub id is marked local, so that a card made later does not take it for one
    assert public_model("models/src", str(tmp_path / "models" / "src"), out) == ("./models/src", "../../models/src")
    assert public_model(str(tmp_path / "models" / "src"), str(tmp_path / "models" / "src"), out) == \
        ("../../models/src", "../../models/src")


# ---------------------------------------------------------------- 6. finetune's last line, its missing model


def test_finetune_ends_with_one_line_and_its_report_has_no_absolute_path(tiny, tmp_path, capsys):
    from test_finetune_fixtures import base_recipe, write_recipe

    recipe = base_recipe(tmp_path, tiny["mla"], tiny["llama"], tiny["corpus"])
    recipe["train"]["max_steps"] = 2
    assert main(["finetune", "--config", str(write_recipe(tmp_path / "r.yaml", **recipe))]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    saved = json.loads((tmp_path / "out" / "finetune_report.json").read_text())
    before, after = (saved[k]["validation"]["token_perplexity"] for k in ("eval_before", "eval_after"))
    rows, seq_len = saved["validation_text"]["rows"], saved["validation_text"]["seq_len"]
    assert last == (f"attnkit finetune: wrote {tmp_path / 'out'} (validation ppl {before:.2f} -> {after:.2f}, "
                    f"{rows} × {seq_len}-token rows of the data's validation split)")
    assert _absolute_in_reports(tmp_path / "out") == []


def test_finetune_missing_local_model_names_the_command_that_makes_it(tmp_path, capsys, monkeypatch):
    import shutil

    recipe = shutil.copy(Path(__file__).resolve().parents[1] / "recipes" / "heal-mla.yaml", tmp_path / "heal.yaml")
    monkeypatch.chdir(tmp_path)  # no out/ref-mla30 here: the recipe's default student is not converted yet
    refused_in_one_line(lambda: main(["finetune", "--config", str(recipe)]), capsys, tmp_path / "out",
                        "out/ref-mla30", "local folder does not exist", "attnkit convert --to mla reference -o out/ref-mla30")


def test_intermediates_in_scratch_keep_their_paths_outputs_do_not(tmp_path, src):
    """mla+dex converts to MLA in a scratch folder first; its report is read back, so it keeps its paths."""
    from attnkit.io.checkpoint import scratch_dir

    report = {"source": {"model": str(src), "path": str(src)}, "settings": {"calib": str(src)}}
    with scratch_dir(tmp_path / "out") as scratch:
        with atomic_output_dir(scratch / "mla") as tmp:
            (tmp / "attnkit_report.json").write_text(json.dumps(report))
        assert json.loads((scratch / "mla" / "attnkit_report.json").read_text()) == report
    with atomic_output_dir(tmp_path / "out") as tmp:
        (tmp / "attnkit_report.json").write_text(json.dumps(report))
    public = json.loads((tmp_path / "out" / "attnkit_report.json").read_text())
    assert public == {"source": {"model": src.name, "path": src.name}, "settings": {"calib": src.name}}
