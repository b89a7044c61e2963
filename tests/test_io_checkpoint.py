"""Lazy reader, sharded writer, atomic output folders, model resolution."""

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import LazyCheckpoint, ShardedWriter, atomic_output_dir, check_output_dir
from attnkit.io.resolve import REFERENCE_DIR, check_causal_lm, resolve_model


def _tensors(n=5):
    g = torch.Generator().manual_seed(0)
    return {f"layer.{i}.weight": torch.randn(8, 8, generator=g) for i in range(n)}


@pytest.mark.parametrize("max_bytes", [10**9, 600])
def test_writer_then_lazy_reader_round_trip(tmp_path, max_bytes):
    tensors = _tensors()
    writer = ShardedWriter(tmp_path, max_shard_bytes=max_bytes)
    for name, t in tensors.items():
        writer.add(name, t)
    writer.close()
    sharded = max_bytes < 10**9
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    assert (tmp_path / "model.safetensors").is_file() != sharded
    ckpt = LazyCheckpoint(tmp_path)
    assert sorted(ckpt.keys()) == sorted(tensors)
    for name, t in tensors.items():
        assert torch.equal(ckpt.get(name), t)
    assert ckpt.get("layer.0.weight", dtype=torch.bfloat16).dtype == torch.bfloat16


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.tuples(st.sampled_from(["f32", "bf16", "f16", "i64", "bool", "f64"]),
                                st.lists(st.integers(0, 5), min_size=0, max_size=3)), min_size=1, max_size=8),
       max_bytes=st.sampled_from([1, 40, 10**9]))
def test_streaming_writer_mixed_dtypes_match_safetensors(tmp_path_factory, sizes, max_bytes):
    """Tensors of mixed dtypes and odd sizes (incl. empty and 0-d) stream to disk and read back
    bit-exactly, through safetensors' own loader, in any shard layout; no scratch file is left."""
    from safetensors.torch import load_file

    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i64": torch.int64,
              "bool": torch.bool, "f64": torch.float64}
    folder = tmp_path_factory.mktemp("w")
    g = torch.Generator().manual_seed(len(sizes))
    tensors = {f"t{i}": (torch.randn(tuple(shape), generator=g) * 100).to(dtypes[dt]) for i, (dt, shape) in enumerate(sizes)}
    writer = ShardedWriter(folder, max_shard_bytes=max_bytes)
    for name, t in tensors.items():
        writer.add(name, t)
    writer.close()
    assert not list(folder.glob(".*.part"))
    loaded = {}
    for f in folder.glob("*.safetensors"):
        loaded.update(load_file(str(f)))
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape and torch.equal(loaded[name], t)


def test_writer_refuses_a_name_twice(tmp_path):
    writer = ShardedWriter(tmp_path)
    writer.add("a", torch.zeros(1))
    with pytest.raises(ValueError):
        writer.add("a", torch.zeros(1))


def test_reader_errors(tmp_path):
    with pytest.raises(AttnkitError, match="no safetensors weights"):
        LazyCheckpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(AttnkitError, match="not a readable safetensors"):
        LazyCheckpoint(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    with pytest.raises(AttnkitError, match="missing"):
        LazyCheckpoint(tmp_path)


def test_missing_tensor(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(AttnkitError, match="'b' not found"):
        LazyCheckpoint(tmp_path).get("b")


def test_atomic_output_success_and_failure(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out) as tmp:
            (tmp / "half.bin").write_text("x")
            raise RuntimeError("boom")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with atomic_output_dir(out) as tmp:
        (tmp / "done.txt").write_text("ok")
    assert (out / "done.txt").read_text() == "ok"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_non_empty_output_needs_force(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(AttnkitError, match="not empty"):
        check_output_dir(tmp_path)
    assert check_output_dir(tmp_path, force=True) == tmp_path
    with pytest.raises(AttnkitError, match="not a folder"):
        check_output_dir(tmp_path / "keep.txt")


def test_resolve_local_folder_and_errors(tmp_path, monkeypatch):
    with pytest.raises(AttnkitError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(AttnkitError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(AttnkitError, match="not valid JSON"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(AttnkitError, match="not a causal language model"):
        check_causal_lm(tmp_path)
    with pytest.raises(AttnkitError, match="neither a local folder"):
        resolve_model("not a valid id!")


def test_resolve_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(AttnkitError, match="attnkit-test/does-not-exist"):
        resolve_model("attnkit-test/does-not-exist")


def test_reference_resolves_to_the_bundled_model():
    path = resolve_model("reference")
    assert path == REFERENCE_DIR
    config = check_causal_lm(path)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] == 64
    assert config["num_attention_heads"] == 4 * config["num_key_value_heads"] >= 8
    assert config["max_position_embeddings"] >= 16384
    size = sum(p.stat().st_size for p in path.iterdir())
    assert size <= 50 * 1024**2
