"""`attnkit eval`: JSON schema, retention, KV bytes from the cache, the table, quiet output, its error paths,
and the bundled tasks from lm-eval's own CLI."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from attnkit.cli import main
from attnkit.evaluation import present, run, score
from attnkit.evaluation import tasks as bundled
from attnkit.io.resolve import REFERENCE_DIR


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Llama with the reference tokenizer, saved like any HF checkpoint."""
    folder = tmp_path_factory.mktemp("tiny")
    tok = AutoTokenizer.from_pretrained(REFERENCE_DIR)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, max_position_embeddings=2048, eos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_task_groups_expand():
    assert bundled.expand("attnkit-core") == bundled.BUNDLED
    assert bundled.expand("attnkit-recall,attnkit-ppl") == [*bundled.RECALL, "attnkit-ppl"]
    assert bundled.expand("attnkit-quick") == ["attnkit-ppl-quick", "attnkit-complete-quick", "attnkit-recall-256"]


def test_bundled_yamls_are_ready_and_match_the_groups():
    """Every task has a YAML without placeholders; the group YAMLs list what `expand` gives."""
    import yaml

    for name in bundled.TASKS:
        text = (bundled.HERE / f"{name}.yaml").read_text()
        assert "{" not in text.replace("{{", "")  # no template placeholders left
        assert bundled.items(name)  # its data loads
    for group, members in bundled.GROUPS.items():
        assert yaml.safe_load((bundled.HERE / f"{group}.yaml").read_text()) == {"group": group, "task": members}
    # the quick tasks are the first items of the full ones
    assert bundled.items("attnkit-ppl-quick") == bundled.items("attnkit-ppl")[:8]
    assert bundled.items("attnkit-complete-quick") == bundled.items("attnkit-complete")[:100]


def test_lm_eval_task_manager_reads_the_folder_as_shipped():
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(bundled.HERE), include_defaults=False)
    assert set(bundled.TASKS) | set(bundled.GROUPS) <= set(manager.all_tasks)
    if hasattr(manager, "load"):  # lm-eval >= 0.4.10; load_task_or_group warns there
        task = manager.load(["attnkit-complete-quick"])["tasks"]["attnkit-complete-quick"]
    else:
        task = manager.load_task_or_group(["attnkit-complete-quick"])["attnkit-complete-quick"]
    assert len(task.test_docs()) == 100


def test_tasks_path_prints_the_folder(capsys):
    assert main(["tasks", "path"]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert (folder / "attnkit-core.yaml").is_file() and (folder / "attnkit_data.py").is_file()


@pytest.mark.slow
def test_eval_with_baseline_writes_the_documented_schema(tiny_model, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["eval", str(tiny_model), "--baseline", str(tiny_model), "--tasks", "attnkit-ppl,attnkit-recall-256",
                 "--limit", "2", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["schema"] == "attnkit.eval/v1"
    assert result["tasks"] == ["attnkit-ppl", "attnkit-recall-256"]
    assert result["limit"] == 2  # a partial run says so: the model card keeps it out of model-index
    model = result["models"]["model"]
    assert set(model) >= {"name", "path", "params", "dtype", "kv_cache_bytes_per_token", "metrics"}
    # 2 (K, V) x 2 layers x 2 KV heads x head_dim 8 x 4 bytes, measured from the cache object
    assert model["kv_cache_bytes_per_token"] == 2 * 2 * 2 * 8 * 4
    ppl = model["metrics"]["attnkit-ppl"]
    assert ppl["token_perplexity"] > 1 and ppl["byte_perplexity"] > 1
    assert 0 <= model["metrics"]["attnkit-recall-256"]["acc"] <= 1
    # the same model as its own baseline keeps everything
    ratios = [v for v in result["retention"].values() if v is not None]
    assert ratios and all(v == pytest.approx(1.0) for v in ratios)
    assert model["n"] == {"attnkit-ppl": 2, "attnkit-recall-256": 2}
    assert model["higher_is_better"]["attnkit-ppl"]["token_perplexity"] is False
    assert model["higher_is_better"]["attnkit-recall-256"]["acc"] is True
    table = capsys.readouterr().out
    assert "retention" in table and "token_perplexity" in table and "KV bytes/token (fp32, as stored)" in table
    assert "in this run" not in table  # an fp32 checkpoint run in fp32: one KV row
    header = table.splitlines()[0].split()
    assert header[:5] == ["task", "metric", "better", "n", "model"]
    recall = next(line.split() for line in table.splitlines() if line.startswith("attnkit-recall-256"))
    assert recall[:4] == ["attnkit-recall-256", "acc", "higher", "2"]


def _result(with_baseline: bool = True) -> dict:
    model = {"metrics": {"attnkit-ppl": {"token_perplexity": 33.0}, "attnkit-recall-256": {"acc": 0.4, "acc_stderr": 0.1}},
             "n": {"attnkit-ppl": 24, "attnkit-recall-256": 40}, "kv_cache_bytes_per_token": 1216, "params": 6,
             "dtype": "bfloat16", "kv_cache_dtype": "bfloat16",
             "higher_is_better": {"attnkit-ppl": {"token_perplexity": False}, "attnkit-recall-256": {"acc": True}}}
    result = {"models": {"model": model}}
    if with_baseline:
        base = {**model, "metrics": {"attnkit-ppl": {"token_perplexity": 30.0}, "attnkit-recall-256": {"acc": 0.5}},
                "kv_cache_bytes_per_token": 4096, "params": 5}
        result["models"]["baseline"] = base
        result["retention"] = score.retention(model, base)
    return result


def test_table_says_direction_items_and_kv_dtype():
    lines = present.format_table(_result()).splitlines()
    rows = {tuple(line.split()[:2]): line.split() for line in lines[2:] if line.startswith(("attnkit", "model"))}
    assert rows[("attnkit-ppl", "token_perplexity")][2:] == ["lower", "24", "33.0000", "30.0000", "1.100"]
    assert rows[("attnkit-recall-256", "acc")][2:] == ["higher", "40", "0.4000", "0.5000", "0.800"]
    kv = next(line for line in lines if "KV bytes/token" in line)
    assert "KV bytes/token (bf16, as stored)" in kv and kv.split()[-3:] == ["1,216", "4,096", "0.297"]
    assert any(line.startswith("retention = model / baseline") for line in lines)
    alone = present.format_table(_result(with_baseline=False))
    assert "retention" not in alone and "KV bytes/token (bf16, as stored)" in alone
    # the perplexity it prints is named with its text and windows (the model card says the same)
    from attnkit.evaluation.ppl import TASK_SENTENCE

    assert lines[-1] == TASK_SENTENCE and "1024-token windows" in TASK_SENTENCE
    result = _result()
    result["models"]["model"]["metrics"]["attnkit-ppl"]["word_perplexity"] = 21470.9  # lm-eval's: in the JSON only
    assert "word_perplexity" not in present.format_table(result)


def test_table_gives_the_stored_and_the_measured_kv_dtype():
    """A bf16 checkpoint evaluated in fp32: the stored figure (what convert and bench print) and this run's."""
    result = _result()
    for role, n in (("model", 1216), ("baseline", 4096)):
        result["models"][role].update(dtype="float32", kv_cache_measured={"bytes_per_token": 2 * n, "dtype": "fp32"})
    result["retention"] = score.retention(result["models"]["model"], result["models"]["baseline"])
    lines = present.format_table(result).splitlines()
    stored = next(line for line in lines if "KV bytes/token (bf16, as stored)" in line)
    measured = next(line for line in lines if "KV bytes/token (fp32, in this run)" in line)
    assert stored.split()[-3:] == ["1,216", "4,096", "0.297"] and measured.split()[-3:] == ["2,432", "8,192", "0.297"]
    result["models"]["baseline"]["kv_cache_dtype"] = "fp32"  # stored in different dtypes: each figure says its own
    assert "1,216 bf16" in present.format_table(result) and "4,096 fp32" in present.format_table(result)


def test_missing_baseline_fails_before_any_model_loads(tiny_model, monkeypatch, capsys):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a model was loaded or evaluated before --baseline was checked")

    monkeypatch.setattr(score, "load_model", must_not_run)
    monkeypatch.setattr(run, "evaluate", must_not_run)
    assert main(["eval", str(tiny_model), "--baseline", "/no/such/baseline"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/no/such/baseline" in err[0] and "does not exist" in err[0]
    folder = tiny_model.parent / "not-causal"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaModel"], "model_type": "llama"}))
    assert main(["eval", str(tiny_model), "--baseline", str(folder)]) == 2
    assert "not a causal language model" in capsys.readouterr().err


def _attnkit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The installed console script, run as a user would (outside any git checkout)."""
    script = Path(sys.executable).parent / "attnkit"
    return subprocess.run([str(script), *args], cwd=cwd, env=_env(cwd), capture_output=True, text=True, timeout=900)


def _env(cwd: Path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "GIT_CEILING_DIRECTORIES": str(cwd.parent)}


LM_EVAL_NOISE = ["`pretrained` model kwarg", "aggregation", "higher_is_better", "Generating test split",
                 "fatal: not a git repository", "Custom kwargs"]
MARK = "=== now with --verbose ==="
# one fresh process (real stderr, as for a user) runs both: a second Python start-up would double the cost
QUIET_THEN_VERBOSE = f"""
import sys
from attnkit.cli import main
argv = sys.argv[1:]
assert main(argv) == 0
print({MARK!r}, file=sys.stderr, flush=True)
assert main(argv + ["--verbose"]) == 0
"""


@pytest.mark.slow
def test_quiet_by_default_and_verbose_shows_lm_evals_output(tiny_model, tmp_path):
    argv = ["eval", str(tiny_model), "--tasks", "attnkit-recall-256", "--limit", "1"]
    done = subprocess.run([sys.executable, "-c", QUIET_THEN_VERBOSE, *argv], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    quiet, loud = done.stderr.split(MARK)
    assert done.stdout.count("attnkit-recall-256") == 2  # both tables
    assert not [w for w in LM_EVAL_NOISE if w in quiet], quiet
    assert f"[1/1] {tiny_model}" in quiet  # the progress bar names the model
    assert "`pretrained` model kwarg" in loud
    if shutil.which("git"):  # lm-eval asks `git describe` for its environment report
        assert "fatal: not a git repository" in loud


@pytest.mark.slow
def test_bundled_tasks_run_from_lm_evals_own_cli(tiny_model, tmp_path):
    path = _attnkit("tasks", "path", cwd=tmp_path)
    assert path.returncode == 0
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={tiny_model}",
           "--include_path", path.stdout.strip(), "--tasks", "attnkit-core", "--limit", "1", "--device", "cpu"]
    done = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in bundled.BUNDLED:
        assert f"- {name}" in done.stdout  # a row of lm-eval's table under the attnkit-core group
    assert "byte_perplexity" in done.stdout and "acc" in done.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "/no/such/model"], "does not exist"),
        (["eval", "{tiny}", "--tasks", "attnkit-nope"], "unknown task 'attnkit-nope'"),
        (["eval", "{tiny}", "--out", "{tmp}"], "is a folder"),
    ],
)
def test_eval_bad_input_is_one_line(argv, message, tiny_model, tmp_path, capsys):
    argv = [a.replace("{tiny}", str(tiny_model)).replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_corrupt_weights_and_non_causal_folders(tiny_model, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    assert main(["eval", str(broken)]) == 2
    assert "cannot load" in capsys.readouterr().err
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["LlamaModel"]
    (broken / "config.json").write_text(json.dumps(config))
    assert main(["eval", str(broken)]) == 2
    assert "not a causal language model" in capsys.readouterr().err
