"""`attnkit push` against a local Hub-compatible server (tests/hub_server.py): no network."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from attnkit.cli import main as cli_main
from conftest import tree_digest
from tests.hub_server import HubServer

TOKEN = "hf_test_token"


def _tiny_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(60)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(folder)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama saved like a convert OUT, with a hand-written attnkit_report.json."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("out") / "tiny-mla"
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(folder)
    _tiny_tokenizer(folder)
    report = {
        "attnkit_version": "0.1.0", "method": "mla",
        "source": {"model": "meta-llama/Llama-3.2-1B", "path": "/cache/llama", "model_type": "llama",
                   "sha256_config": "ab" * 32, "sha256_weights_index": "cd" * 32},
        "settings": {"kv_lora_rank": 16, "rope_dim": 8, "rope_method": "rorope", "dtype": "fp32"},
        "kv_cache_bytes_per_token": {"before": 512, "after": 96},
        "steps": [{"name": "exact_rewrite", "exact": True, "logits_rel_err_max": 3e-7},
                  {"name": "lowrank", "exact": False, "kl": 0.02, "ppl": 11.5}],
        "ppl": {"before": 10.0, "after": 11.5},
        "load": {"trust_remote_code": False, "rope_frequencies": "exact"},
    }
    (folder / "attnkit_report.json").write_text(json.dumps(report))
    (folder / "eval_results.json").write_text(json.dumps({
        "schema": "attnkit.eval/v1", "tasks": ["attnkit-ppl", "attnkit-complete"],
        "models": {"model": {"name": "tiny-mla", "metrics": {"attnkit-ppl": {"token_perplexity": 11.5}, "attnkit-complete": {"acc": 0.4}}},
                   "baseline": {"name": "source", "metrics": {"attnkit-ppl": {"token_perplexity": 10.0}, "attnkit-complete": {"acc": 0.5}}}},
        "retention": {"attnkit-ppl/token_perplexity": 0.87, "attnkit-complete/acc": 0.8},
    }))
    # training leftovers and caches that must never be uploaded
    (folder / "checkpoint-100").mkdir()
    (folder / "checkpoint-100" / "optimizer.pt").write_bytes(b"x" * 10)
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "x.lock").write_text("")
    (folder / "scratch.tmp").write_text("tmp")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\0")
    return folder


@pytest.fixture
def online(monkeypatch, tmp_path):
    """Undo the test suite's HF_HUB_OFFLINE and hide any saved login; HF_TOKEN unset."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)


def _reshard(f: Path) -> None:
    """Rewrite the weights as several shards + index, as big checkpoints are."""
    from attnkit.io.checkpoint import LazyCheckpoint, ShardedWriter

    ckpt = LazyCheckpoint(f)
    tensors = {name: ckpt.get(name) for name in ckpt.keys()}
    (f / "model.safetensors").unlink()
    writer = ShardedWriter(f, max_shard_bytes=20_000)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _push(folder, hub, *extra, token=TOKEN) -> int:
    argv = ["push", str(folder), "--repo-id", "alice/tiny-mla", "--endpoint", hub.url, *extra]
    return cli_main(argv + (["--token", token] if token else []))


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("attnkit: error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


def test_push_uploads_byte_identical_files_and_card(model_dir, online, tmp_path, capsys):
    folder = _copy(model_dir, tmp_path)
    with HubServer(TOKEN) as hub:
        assert _push(folder, hub, "--private") == 0
        captured = capsys.readouterr()
        out = captured.out
        remote = hub.files("alice/tiny-mla")
        assert hub.repos["alice/tiny-mla"].private
    assert re.search(rf"{re.escape(hub.url)}/alice/tiny-mla/commit/[0-9a-f]{{40}}", out), out
    local = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    expected = {k: v for k, v in local.items() if not k.startswith(("checkpoint-100/", ".cache/", "__pycache__/")) and k != "scratch.tmp"}
    assert set(remote) == set(expected)
    for name, data in expected.items():
        if name != "attnkit_report.json":
            assert remote[name] == data, name  # byte-identical, weights included
    # ... but no absolute local path goes out: the report's source folder by its name
    report, sent = json.loads(expected["attnkit_report.json"]), json.loads(remote["attnkit_report.json"])
    assert sent["source"]["path"] == "llama" and sent == {**report, "source": {**report["source"], "path": "llama"}}
    assert "absolute local paths in attnkit_report.json" in captured.err
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md", "attnkit_report.json"} <= set(remote)
    # the card holds the metadata, and the Hub's validator saw the same card
    meta = yaml.safe_load(remote["README.md"].decode().split("---\n")[1])
    assert meta["base_model"] == "meta-llama/Llama-3.2-1B"
    assert meta["base_model_relation"] == "finetune"
    assert meta["library_name"] == "transformers"
    assert {"attnkit", "mla"} <= set(meta["tags"])
    results = meta["model-index"][0]["results"]
    got = {(r["dataset"]["type"], m["type"]): m["value"] for r in results for m in r["metrics"]}
    assert got == {("attnkit-ppl", "token_perplexity"): 11.5, ("attnkit-complete", "acc"): 0.4}
    assert hub.cards and set(hub.cards) == {remote["README.md"].decode()}


def test_push_token_from_env_endpoint_from_env_and_pr(model_dir, online, monkeypatch, tmp_path, capsys):
    folder = _copy(model_dir, tmp_path)
    with HubServer(TOKEN) as hub:
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        assert cli_main(["push", str(folder), "--repo-id", "alice/tiny-mla"]) == 0
        repo = hub.repos["alice/tiny-mla"]
        main_files = dict(repo.refs["main"])
        # a second push of the same folder resumes/no-ops: unchanged files are skipped, no commit
        assert cli_main(["push", str(folder), "--repo-id", "alice/tiny-mla"]) == 0
        assert len(repo.commits) == 1
        capsys.readouterr()
        # new eval results -> the card changes -> a pull request with just those two files
        results = json.loads((folder / "eval_results.json").read_text())
        results["models"]["model"]["metrics"]["attnkit-complete"]["acc"] = 0.45
        (folder / "eval_results.json").write_text(json.dumps(results))
        assert cli_main(["push", str(folder), "--repo-id", "alice/tiny-mla", "--create-pr"]) == 0
        out = capsys.readouterr().out
    assert f"{hub.url}/alice/tiny-mla/discussions/1" in out
    assert repo.refs["main"] == main_files
    changed = {k for k, v in repo.refs["refs/pr/1"].items() if main_files.get(k) != v}
    assert changed == {"eval_results.json", "README.md"}
    assert b"value: 0.45" in repo.refs["refs/pr/1"]["README.md"]


def test_push_to_branch(model_dir, online, tmp_path, capsys):
    folder = _copy(model_dir, tmp_path)
    with HubServer(TOKEN) as hub:
        assert _push(folder, hub, "--revision", "mla-r16") == 0
        repo = hub.repos["alice/tiny-mla"]
    assert repo.refs["main"] == {}
    assert repo.refs["mla-r16"]["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert f"{hub.url}/alice/tiny-mla/tree/mla-r16" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("route", "status", "words"),
    [
        ("create_repo", 401, "rejected the token"),
        ("create_repo", 403, "may not write to alice/tiny-mla (403"),
        ("preupload", 404, "not found"),
        ("commit", 500, "server error (500)"),
        ("create_repo", 503, "server error (503)"),
    ],
)
def test_push_http_errors_are_one_line(model_dir, online, monkeypatch, tmp_path, capsys, route, status, words):
    import huggingface_hub.utils._http as hf_http

    # huggingface_hub retries a failed commit with exponential backoff (~23 s); don't wait in tests
    monkeypatch.setattr(hf_http.time, "sleep", lambda seconds: None)
    folder = _copy(model_dir, tmp_path)
    with HubServer(TOKEN) as hub:
        hub.fail[route] = status
        assert _push(folder, hub) == 2
        assert not any(repo.commits for repo in hub.repos.values())
    assert words in _one_line_error(capsys)


def _unreachable_endpoint() -> str:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("card", ["none", "generated"])
@pytest.mark.parametrize(
    ("failure", "words"),
    [
        (("validate_yaml", 400), "rejected the model card metadata"),
        (("create_repo", 403), "may not write to"),
        (("preupload", 404), "not found"),
        (("commit", 500), "server error (500)"),
        ("unreachable", "cannot reach the Hub"),
    ],
    ids=["card-refused", "403", "404", "500", "unreachable"],
)
def test_failed_push_changes_nothing_in_the_folder(model_dir, online, monkeypatch, tmp_path, capsys, card, failure, words):
    """The refreshed card travels in the upload; the folder is written only after the push succeeded."""
    import huggingface_hub.utils._http as hf_http

    from attnkit.card.build import write_model_card

    monkeypatch.setattr(hf_http.time, "sleep", lambda seconds: None)  # no backoff waits on 500
    folder = _copy(model_dir, tmp_path)
    if card == "generated":
        write_model_card(folder)  # as convert leaves it: no repo id in the loading snippet yet
    before = tree_digest(folder)
    with HubServer(TOKEN) as hub:
        if failure == "unreachable":
            argv = ["push", str(folder), "--repo-id", "alice/tiny-mla", "--endpoint", _unreachable_endpoint(), "--token", TOKEN]
            assert cli_main(argv) == 2
        else:
            hub.fail[failure[0]] = failure[1]
            assert _push(folder, hub) == 2
    assert words in _one_line_error(capsys)
    assert tree_digest(folder) == before


def test_successful_push_leaves_the_pushed_card_in_the_folder(model_dir, online, tmp_path):
    folder = _copy(model_dir, tmp_path)
    before = tree_digest(folder)
    with HubServer(TOKEN) as hub:
        assert _push(folder, hub) == 0
        remote = hub.files("alice/tiny-mla")
    assert (folder / "README.md").read_bytes() == remote["README.md"]
    assert b'from_pretrained("alice/tiny-mla")' in remote["README.md"]
    after = tree_digest(folder)
    assert {k: v for k, v in after.items() if k != "README.md"} == before  # nothing else written
    assert not list(folder.glob("*.tmp.*")) and not list(Path(tempfile.gettempdir()).glob(f".attnkit-push.attnkit-tmp-{os.getpid()}-*"))


def test_a_killed_push_leaves_no_staging_folder_behind(model_dir, online, tmp_path):
    """The staging folder of a push killed with SIGKILL (its pid gone) is removed by the next push."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that no longer runs
    stale = Path(tempfile.gettempdir()) / f".attnkit-push.attnkit-tmp-{child.pid}-deadbeef"
    stale.mkdir()
    (stale / "README.md").write_text("left by a killed push")
    with HubServer(TOKEN) as hub:
        assert _push(_copy(model_dir, tmp_path), hub) == 0
    assert not stale.exists()


def test_push_wrong_token_is_401(model_dir, online, tmp_path, capsys):
    with HubServer(TOKEN) as hub:
        assert _push(_copy(model_dir, tmp_path), hub, token="hf_wrong") == 2
        assert not hub.repos
    assert "rejected the token (401" in _one_line_error(capsys)


def test_push_without_token_fails_before_network(model_dir, online, tmp_path, capsys):
    with HubServer(TOKEN) as hub:
        assert _push(_copy(model_dir, tmp_path), hub, token=None) == 2
        assert hub.log == []
    assert "no Hub token" in _one_line_error(capsys)


def _break_config(f: Path) -> None:
    (f / "config.json").write_text("{not json")


def _drop_weights(f: Path) -> None:
    (f / "model.safetensors").unlink()


def _truncate_weights(f: Path) -> None:
    data = (f / "model.safetensors").read_bytes()
    (f / "model.safetensors").write_bytes(data[: len(data) // 2])


def _drop_a_tensor(f: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(f / "model.safetensors")
    tensors.pop("model.layers.0.self_attn.k_proj.weight")
    save_file(tensors, f / "model.safetensors", metadata={"format": "pt"})


def _shard_without_its_tensor(f: Path) -> None:
    _reshard(f)
    index = json.loads((f / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = sorted(set(index["weight_map"].values()))[0]
    if index["weight_map"]["model.norm.weight"] == sorted(set(index["weight_map"].values()))[-1]:
        raise AssertionError("test needs several shards")
    (f / "model.safetensors.index.json").write_text(json.dumps(index))


def _unknown_model_type(f: Path) -> None:
    config = json.loads((f / "config.json").read_text())
    config["model_type"] = "no_such_arch"
    (f / "config.json").write_text(json.dumps(config))


def _drop_tokenizer(f: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (f / name).unlink()


def _dangling_auto_map(f: Path) -> None:
    config = json.loads((f / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_dex.DexForCausalLM"}
    (f / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (_break_config, "does not parse"),
        (_drop_weights, "no safetensors weights"),
        (_truncate_weights, "not a readable safetensors"),
        (_drop_tokenizer, "no tokenizer"),
        (_drop_a_tensor, "lack 1 tensor(s) that config.json's model needs, e.g. model.layers.0.self_attn.k_proj.weight"),
        (_shard_without_its_tensor, "lacks tensors that model.safetensors.index.json lists"),
        (_unknown_model_type, "cannot build a causal LM"),
        (_dangling_auto_map, "modeling_dex.py"),
    ],
)
def test_push_refuses_a_folder_that_does_not_load(model_dir, online, tmp_path, capsys, damage, words):
    folder = _copy(model_dir, tmp_path)
    damage(folder)
    with HubServer(TOKEN) as hub:
        assert _push(folder, hub) == 2
        assert hub.log == []  # refused before any network call
    assert words in _one_line_error(capsys)


def test_push_refuses_bad_repo_id_and_offline(model_dir, online, monkeypatch, tmp_path, capsys):
    from huggingface_hub import constants

    folder = _copy(model_dir, tmp_path)
    with HubServer(TOKEN) as hub:
        assert cli_main(["push", str(folder), "--repo-id", "no-namespace", "--endpoint", hub.url, "--token", TOKEN]) == 2
        assert "USER/NAME" in _one_line_error(capsys)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        assert _push(folder, hub) == 2
        assert "HF_HUB_OFFLINE" in _one_line_error(capsys)
        assert hub.log == []


def test_push_keeps_a_hand_written_card(model_dir, online, tmp_path):
    folder = _copy(model_dir, tmp_path)
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# my own card\n")
    with HubServer(TOKEN) as hub:
        assert _push(folder, hub) == 0
        assert hub.files("alice/tiny-mla")["README.md"] == b"---\nlicense: mit\n---\n# my own card\n"


def test_push_refuses_card_the_hub_rejects_before_creating_the_repo(model_dir, online, tmp_path, capsys):
    folder = _copy(model_dir, tmp_path)
    (folder / "README.md").write_text("---\nbase_model: a/b\nbase_model_relation: conversion\n---\n# card\n")
    with HubServer(TOKEN) as hub:
        assert _push(folder, hub) == 2
        assert not hub.repos
    assert "rejected the model card metadata" in _one_line_error(capsys)


def test_push_unreachable_hub(model_dir, online, tmp_path, capsys):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["push", str(_copy(model_dir, tmp_path)), "--repo-id", "alice/x", "--endpoint", f"http://127.0.0.1:{port}", "--token", TOKEN]
    assert cli_main(argv) == 2
    assert "cannot reach the Hub at http://127.0.0.1:" in _one_line_error(capsys)


def test_push_sharded_and_tied_checkpoints(tmp_path, online):
    """Index + shards arrive intact; tied embeddings (no lm_head tensor) are not "missing"."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path / "tied"
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    _tiny_tokenizer(folder)
    _reshard(folder)
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    with HubServer(TOKEN) as hub:
        assert cli_main(["push", str(folder), "--repo-id", "alice/tied", "--endpoint", hub.url, "--token", TOKEN]) == 0
        remote = hub.files("alice/tied")
    for name in [*shards, "model.safetensors.index.json"]:
        assert remote[name] == (folder / name).read_bytes()


def test_push_refuses_native_mla_folder_missing_its_latent_norm(tmp_path, online, capsys):
    """A dense DeepSeek-V3 (MLA) output is checked too, though transformers converts that model type on load."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    folder = tmp_path / "mla"
    config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
                              qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
                              n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    DeepseekV3ForCausalLM(config).save_pretrained(folder)
    _tiny_tokenizer(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors.pop("model.layers.0.self_attn.kv_a_layernorm.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with HubServer(TOKEN) as hub:
        assert cli_main(["push", str(folder), "--repo-id", "alice/mla", "--endpoint", hub.url, "--token", TOKEN]) == 2
        assert hub.log == []
    assert "kv_a_layernorm" in _one_line_error(capsys)
