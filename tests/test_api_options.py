"""`attnkit eval` / `attnkit bench` and `attnkit.evaluate` / `attnkit.bench` share one source of options
(`attnkit/evaluation/options.py`): the parser's defaults are the classes', the API refuses what the CLI
refuses in the same words, and bench takes a model already in memory."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit.cli import build_parser, main
from attnkit.evaluation.options import BenchOptions, EvalOptions
from attnkit.options import fields_of, flag_of

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import family_model, save_model  # noqa: E402


def _parser(command: str):
    return build_parser()._subparsers._group_actions[0].choices[command]


@pytest.mark.parametrize("command, cls", [("eval", EvalOptions), ("bench", BenchOptions)])
def test_the_command_line_is_built_from_the_option_class(command, cls):
    actions = {a.dest: a for a in _parser(command)._actions}
    for f, kind in fields_of(cls):
        action = actions[f.name]
        assert flag_of(f) in action.option_strings and action.help == f.metadata["option"]["help"]
        assert (tuple(action.default) if kind is tuple else action.default) == f.default
    parsed = build_parser().parse_args([command, "M"])
    assert dataclasses.asdict(cls()) == {k: (tuple(v) if isinstance(v, list) else v)
                                         for k, v in vars(parsed).items() if k in dataclasses.asdict(cls())}


@pytest.mark.parametrize("call, words", [
    (lambda: attnkit.bench("reference", context=[256], repeat=1), "bench() has no option 'repeat' (options: attn,"),
    (lambda: attnkit.bench("reference", context=[0, 256]), "--context takes comma-separated positive integers, got [0, 256]"),
    (lambda: attnkit.bench("reference", attn="fast"), "--attn must be one of absorbed, expanded, auto, got 'fast'"),
    (lambda: attnkit.bench("reference", threads=0), "--threads must be at least 1 (leave it out for torch's choice), got 0"),
    (lambda: attnkit.evaluate("reference", batch_size=0), "--batch-size must be at least 1, got 0"),
    (lambda: attnkit.evaluate("reference", limt=2), "evaluate() has no option 'limt' (options: batch_size, device,"),
])
def test_the_api_refuses_in_one_line_before_any_work(call, words):
    with pytest.raises(attnkit.AttnkitError) as err:
        call()
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_cli_refuses_the_same_way(capsys):
    assert main(["bench", "reference", "--threads", "0"]) == 2
    assert capsys.readouterr().err.strip().endswith("--threads must be at least 1 (leave it out for torch's choice), got 0")


def test_bench_takes_an_in_memory_model(tmp_path, capsys):
    model, _ = family_model("llama")
    model.eval()
    baseline = save_model(tmp_path / "src", "llama")
    result = attnkit.bench(model, baseline=str(baseline), context=[24], repeats=1, decode_tokens=2)
    measured = result["models"]["model"]
    assert measured["name"].startswith("LlamaForCausalLM") and measured["path"] is None
    assert measured["results"][0]["status"] == "ok" and result["models"]["baseline"]["path"] == str(baseline)
    assert result["settings"]["model"] == measured["name"]
    json.dumps(result)  # what --out would write
    assert "LlamaForCausalLM" in capsys.readouterr().out


def test_bench_measures_an_in_memory_model_where_it_is():
    model, _ = family_model("llama")
    with pytest.raises(attnkit.AttnkitError, match="in its own dtype and on its own device"):
        attnkit.bench(model, dtype="bf16")
    with pytest.raises(attnkit.AttnkitError, match="not fp64"):
        attnkit.bench(model.to(torch.float64))
