"""The command line: every sub-command documents its options; bad input is one line and exit 2."""

import subprocess
import sys

import pytest

from attnkit.cli import HANDLERS, build_parser, main

COMMANDS = ["convert", "finetune", "eval", "bench", "push", "pretrain", "tasks"]


def test_every_spec_command_is_registered():
    assert sorted(HANDLERS) == sorted(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_documents_every_option(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    for action in sub._actions:
        for flag in action.option_strings:
            assert flag in text
        if action.help is not None and action.option_strings:
            assert action.help  # no undocumented option


def test_convert_spec_flags_exist():
    args = build_parser().parse_args(
        ["convert", "--to", "mla", "m", "-o", "o", "--kv-lora-rank", "8", "--rope-dim", "4", "--rope-method", "partial",
         "--calib", "python", "--calib-tokens", "10", "--dtype", "bf16", "--device", "cpu"]
    )
    assert (args.kv_lora_rank, args.rope_dim, args.rope_method, args.dtype) == (8, 4, "partial", "bf16")


def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnkit: error:") and "does not exist" in err[0]


def test_console_script_runs_in_a_fresh_process():
    """The `attnkit` entry point installed beside this interpreter (pyproject's [project.scripts]), not `python -m`."""
    import shutil
    from pathlib import Path

    bindir = Path(sys.executable).parent
    script = shutil.which("attnkit", path=str(bindir))
    assert script is not None, f"no attnkit console script in {bindir}: is the package installed (pip install -e .)?"
    out = subprocess.run([script, "--help"], capture_output=True, text=True, check=True)
    assert "convert" in out.stdout and "pretrain" in out.stdout
    bad = subprocess.run([script, "convert"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip()  # argparse's usage error, through the script's exit code


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_defaults_and_an_example(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = capsys.readouterr().out
    assert "example:" in text and f"attnkit {command} " in text.split("example:")[1]
    assert "(default: None)" not in text and "(default: False)" not in text
    assert build_parser()._subparsers._group_actions[0].choices[command].description  # push included


def test_convert_help_names_numeric_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 0)" in text and "(default: engines)" in text and "(default: 512)" in text
