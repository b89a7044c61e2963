"""Every command README.md shows, run as written (issue 29: the tour must not rot again).

The fenced shell blocks of README.md are parsed (continuation lines joined, comments dropped, `&&`
chains split) and every `attnkit …` / `accelerate launch …` command in them runs, in README order, in
one working folder under tmp_path, through the console scripts installed beside this interpreter, on
the bundled models. A command that exits non-zero fails its test with the tail of its output.

Scaled down, and only by the reviewed table SCALE_DOWN below: the tour's conversions calibrate on 1,024
tokens, the fine-tunes train a few steps, eval and bench score a few documents and one short context;
the extra arguments are appended after the README's own, where the last value of a flag (argparse) or
of a `key=value` recipe override wins. README.md says so under its tour.

Not run, each for the reason in NOT_RUN: the install (`pip install …`, which CI's `.ci/run` runs in a
fresh virtualenv), the test suite itself, and the two engine scripts (own virtualenvs / a llama.cpp
build). Commands that reach the network run offline: a Hub id (meta-llama/Llama-3.2-1B) is a tiny
stand-in with that model's published config (heads, head_dim, RoPE scaling; sizes shrunk, see
STAND_INS) placed in a private offline Hub cache under that id, and `attnkit push` publishes to the
local Hub-compatible server the push tests use (tests/hub_server.py) through HF_ENDPOINT and HF_TOKEN.

Inline `attnkit …` code spans of the README are runs too when concrete (INLINE_RUN); synopses with
placeholders (MODEL, OUT, …) and bare command names (`attnkit eval`) are not, and a concrete span that
is not run names its reason in
INLINE_NOT_RUN: a new inline command fails test_every_readme_command_is_run_or_excluded until it is
classified here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.hub_server import HubServer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent  # the console scripts (`attnkit`, `accelerate`) of this environment
TOKEN = "hf_readme_token"

# ---------------------------------------------------------------- what is not run, and why

NOT_RUN = {
    ("pip", "install"): "the install: CI's .ci/run installs exactly this in a fresh virtualenv before the tests",
    ("python", "-m", "pytest"): "the test suite itself (this test is part of it)",
    ("python", "benchmarks/engines/vllm_cpu.py"): "needs a vLLM CPU build in its own virtualenv; "
    "tests/test_engines_script.py tests the script's own logic",
    ("python", "benchmarks/engines/llama_cpp.py"): "builds llama.cpp from source (~8 CPU-minutes); "
    "tests/test_engines_script.py tests the script's own logic",
}
# inline code spans that are concrete commands, run after the fenced blocks (they use their outputs)
INLINE_RUN = [
    # the quick start's `--eval`, spelled as its own command
    "attnkit eval out/ref-mla --baseline reference --out out/ref-mla/eval_results.json",
]
INLINE_NOT_RUN = {
    "attnkit finetune --config recipes/heal-mla.yaml": "the table's synopsis; the tour runs it with model=… output_dir=…",
    "attnkit pretrain --config recipes/reference.yaml": "rebuilds the bundled model (a tokenizer and 5 M training "
    "tokens, CPU-hours); tests/test_pretrain.py runs the same code on a tiny corpus",
}
PLACEHOLDERS = re.compile(r"\b(MODEL|OUT|SRC|USER/NAME|N|W)\b")

# ---------------------------------------------------------------- the scale-down table (reviewed)

FAST_CALIB = ["--calib-tokens", "1024", "--eval-tokens", "512"]  # 2 calibration rows of 512 tokens, 1 held-out row
FAST_FINETUNE = ["data.tokens=1024", "data.seq_len=256", "data.val_tokens=512", "eval.limit=1"]  # 4 steps
SCALE_DOWN = {
    ("attnkit", "convert"): FAST_CALIB,  # and `--limit 4` with `--eval` (added in scaled())
    ("attnkit", "finetune"): FAST_FINETUNE,
    ("accelerate", "launch"): FAST_FINETUNE,  # and a free --main_process_port (added in scaled())
    ("attnkit", "eval"): ["--limit", "4"],
    ("attnkit", "bench"): ["--context", "256", "--repeats", "1", "--decode-tokens", "4"],
    ("attnkit", "push"): [],
}

# ---------------------------------------------------------------- Hub ids: offline stand-ins


def llama_3_2_1b(folder: Path) -> None:
    """meta-llama/Llama-3.2-1B's published config (tests/data/configs) with its head geometry kept, 32 query
    and 8 KV heads of 64 (so --kv-lora-rank 512 --rope-dim 64 fit as they do on the real model), llama3
    RoPE scaling, tied embeddings; one layer, width 64, 256-token vocabulary, random bf16 weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mla_fixtures import tokenizer

    fields = json.loads((ROOT / "tests" / "data" / "configs" / "meta-llama--Llama-3.2-1B.json").read_text())
    for key in ("torch_dtype", "transformers_version"):
        fields.pop(key, None)
    fields.update(hidden_size=64, intermediate_size=96, num_hidden_layers=1, vocab_size=256, bos_token_id=1,
                  eos_token_id=2)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    tokenizer(256).save_pretrained(folder)


STAND_INS = {"meta-llama/Llama-3.2-1B": llama_3_2_1b}


def offline_hub_cache(cache: Path, repo_id: str, build) -> None:
    """`repo_id` in huggingface_hub's cache layout, so that an offline `snapshot_download` finds it."""
    commit = "0" * 40
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    build(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


# ---------------------------------------------------------------- parsing README.md


@dataclass
class Command:
    text: str  # as README writes it (continuations joined)
    env: dict[str, str] = field(default_factory=dict)  # leading VAR=value words
    argv: list[str] = field(default_factory=list)

    def key(self) -> tuple[str, ...]:
        return tuple(self.argv[:2])


def fenced_blocks(text: str) -> list[str]:
    """The bodies of the ``` blocks with no language or a shell one."""
    blocks, body, lang = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if body is None:
                body, lang = [], line[3:].strip()
            else:
                if lang in ("", "sh", "bash", "shell", "console"):
                    blocks.append("\n".join(body))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def commands_of(block: str) -> list[Command]:
    """Shell commands of one block: `\\` continuations joined, comments dropped, `&&` chains split."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            part, words = words[:cut], words[cut + 1:]
            env = {}
            while part and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", part[0]):
                name, _, value = part.pop(0).partition("=")
                env[name] = value
            if part:
                out.append(Command(shlex.join(part), env, part))
    return out


def readme_commands() -> list[Command]:
    text = README.read_text(encoding="utf-8")
    return [c for block in fenced_blocks(text) for c in commands_of(block)]


def inline_spans() -> list[str]:
    """`attnkit …` code spans outside the fenced blocks."""
    text = re.sub(r"^```.*?^```", "", README.read_text(encoding="utf-8"), flags=re.S | re.M)
    spans = (" ".join(m.group(1).replace("\\|", "|").split()) for m in re.finditer(r"`(attnkit [^`]+)`", text))
    return list(dict.fromkeys(spans))


def not_run_reason(cmd: Command) -> str | None:
    for prefix, why in NOT_RUN.items():
        if tuple(cmd.argv[: len(prefix)]) == prefix:
            return why
    return None


def runnable() -> list[Command]:
    fenced = [c for c in readme_commands() if not_run_reason(c) is None]
    return fenced + [commands_of(span)[0] for span in INLINE_RUN]


# ---------------------------------------------------------------- running them


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scaled(cmd: Command) -> list[str]:
    """The argv that runs: the README's words, the scale-down table's appended (see SCALE_DOWN)."""
    argv = list(cmd.argv)
    key = cmd.key()
    assert key in SCALE_DOWN, f"README command {cmd.text!r}: add {key} to SCALE_DOWN (or NOT_RUN with a reason)"
    extra = list(SCALE_DOWN[key])
    if key == ("attnkit", "convert") and "--eval" in argv:
        extra += ["--limit", "4"]
    if key == ("accelerate", "launch"):  # torchrun's rendezvous port: another test run may hold the default 29500
        argv[2:2] = ["--main_process_port", str(free_port())]
    argv[0] = str(BIN / argv[0])
    return argv + extra


@dataclass
class Result:
    argv: list[str]
    returncode: int
    output: str
    seconds: float  # wall
    cpu: float  # user + sys of the command and everything it waited for (steadier on a shared machine)


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Tour:
    """Runs the README's commands in order, each once, in one working folder: command k's test runs
    every command before it first (they make its inputs), so one test can be selected alone."""

    def __init__(self, work: Path, hub) -> None:
        self.work, self.hub = work, hub
        self.commands = runnable()
        self.results: list[Result] = []
        (work / "tmp").mkdir()
        shutil.copytree(ROOT / "recipes", work / "recipes")
        cache = work / "hf" / "hub"
        readme = README.read_text(encoding="utf-8")
        for repo_id, build in STAND_INS.items():
            if repo_id in readme:
                offline_hub_cache(cache, repo_id, build)
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                    "HF_HOME": str(work / "hf"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "TMPDIR": str(work / "tmp"), "PYTHONWARNINGS": "ignore",
                    # one torch thread per command: on a 2-core machine that anything else also uses, torch's
                    # spinning OpenMP threads made a scaled-down conversion 140 s instead of 38 s with one
                    "OMP_NUM_THREADS": "1"}
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT"):
            self.env.pop(name, None)

    def run_upto(self, index: int) -> Result:
        while len(self.results) <= index:
            cmd = self.commands[len(self.results)]
            env = {**self.env, **cmd.env}
            if cmd.key() == ("attnkit", "push"):  # the local Hub, online
                env.update(HF_HUB_OFFLINE="0", HF_ENDPOINT=self.hub.url, HF_TOKEN=TOKEN)
            argv = scaled(cmd)
            started, cpu = time.time(), _children_cpu()
            proc = subprocess.run(argv, cwd=self.work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=600)
            self.results.append(Result(argv, proc.returncode, proc.stdout, round(time.time() - started, 1),
                                       round(_children_cpu() - cpu, 1)))
        return self.results[index]


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    with HubServer(TOKEN) as hub:
        tour = Tour(tmp_path_factory.mktemp("readme"), hub)
        yield tour
    # what each command cost (shown with -s): the README's commands must stay within CI's budget
    for r in tour.results:
        words = shlex.join([Path(r.argv[0]).name, *r.argv[1:]])[:100]
        print(f"{r.seconds:7.1f} s wall {r.cpu:7.1f} s cpu  exit {r.returncode}  {words}")
    print(f"{sum(r.seconds for r in tour.results):7.1f} s wall {sum(r.cpu for r in tour.results):7.1f} s cpu  total")


def _last_lines(text: str, n: int = 40) -> str:
    lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]
    return "\n".join(lines[-n:])


# ---------------------------------------------------------------- tests


def test_every_readme_command_is_run_or_excluded():
    commands = readme_commands()
    assert len(commands) >= 10, [c.text for c in commands]  # the parser found the tour
    for cmd in commands:
        if not_run_reason(cmd) is None:
            assert cmd.key() in SCALE_DOWN, f"README command {cmd.text!r} is neither run (SCALE_DOWN) nor in NOT_RUN"
    for prefix in NOT_RUN:  # no stale entry
        assert any(tuple(c.argv[: len(prefix)]) == prefix for c in commands), prefix
    spans = inline_spans()
    for span in spans:
        if span in INLINE_RUN or span in INLINE_NOT_RUN or len(span.split()) <= 2:  # `attnkit eval`: a name
            continue
        assert PLACEHOLDERS.search(span), f"inline README command {span!r}: add it to INLINE_RUN or INLINE_NOT_RUN"
    for span in [*INLINE_RUN, *INLINE_NOT_RUN]:
        assert span in spans, f"{span!r} is no longer in README.md"


def test_readme_says_the_tests_scale_its_commands_down():
    text = " ".join(README.read_text(encoding="utf-8").split())
    assert "tests/test_readme_commands.py" in text and "scaled down" in text


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(runnable())), ids=[c.text[:80] for c in runnable()])
def test_readme_command_runs(tour, index):
    result = tour.run_upto(index)
    assert result.returncode == 0, (f"README command failed (exit {result.returncode}, {result.seconds} s):\n"
                                    f"  {shlex.join(result.argv)}\n{_last_lines(result.output)}")
    cmd = tour.commands[index]
    if cmd.key() == ("attnkit", "push"):
        _check_push(tour, cmd)


def _check_push(tour: Tour, cmd: Command) -> None:
    """What the push published: the folder's model, its card, and no absolute local path in any file."""
    repo_id = cmd.argv[cmd.argv.index("--repo-id") + 1]
    files = tour.hub.files(repo_id)
    assert {"README.md", "config.json", "model.safetensors"} <= set(files), sorted(files)
    local = [str(tour.work), str(ROOT), str(Path.home())]
    for name, data in files.items():
        if name.endswith(".safetensors"):
            continue
        text = data.decode("utf-8", errors="ignore")
        for path in local:
            assert path not in text, f"{name} in the pushed repo holds the local path {path}"
