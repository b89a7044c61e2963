"""docs/api.md's examples run, in order, in a scratch folder: convert, evaluate (an in-memory model),
bench, heal and push (to the local Hub-compatible server of tests/hub_server.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.hub_server import HubServer

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "api.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
TOKEN = "hf_test_token"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with HubServer(TOKEN) as server:
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def test_api_examples_run(tmp_path, monkeypatch, capsys, hub):
    work = tmp_path / "work"
    work.mkdir()
    (work / "recipes").symlink_to(REPO / "recipes")
    monkeypatch.chdir(work)
    assert len(BLOCKS) >= 8
    namespace: dict = {}
    for i, block in enumerate(BLOCKS):
        exec(compile(block, f"{DOC.name} example {i + 1}", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert "--kv-heads must be in 1..2 (the source's KV heads), got 3" in out and "--to mla does not take TitansConfig" in out
    assert namespace["report"].method == "mla" and 0 < namespace["report"].kv_cache_fraction < 1
    assert namespace["results"]["tasks"] == ["attnkit-ppl"] and (work / "out/ref-mla/eval_results.json").is_file()
    assert "comparison" in namespace["speed"] and "bench() has no option 'repeat' (options: attn, baseline_attn" in out
    assert (work / "out/ref-mla-healed/finetune_report.json").is_file()
    assert "alice/ref-mla-healed" in hub.repos and namespace["url"]
    assert not (work / "out/ref-gqa").exists() and not (work / "out/ref-mla2").exists()  # refused before any work
