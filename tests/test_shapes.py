"""Issue "The first hour": a checkpoint whose tensors disagree with its config is refused before any
work, by every `attnkit convert` method (one line, exit 2, nothing written, source untouched), and
`eval` / `bench` name the tensor in one line instead of transformers' load report."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from attnkit.cli import main
from attnkit.converters.shapes import shape_problem, with_defaults
from attnkit.io.checkpoint import LazyCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import save_model  # noqa: E402
from conftest import tree_digest  # noqa: E402

FAST = ["--calib-tokens", "256", "--calib-seq-len", "32", "--eval-tokens", "128"]
CLASSES = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
           "qwen2": (Qwen2Config, Qwen2ForCausalLM), "phi3": (Phi3Config, Phi3ForCausalLM)}


# ---------------------------------------------------------------- the pure check against transformers' own modules


def _meta_shapes(model_class, config) -> dict:
    """{name: shape} of the state dict transformers builds for `config` (on the meta device: no memory)."""
    with torch.device("meta"):
        model = model_class(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


@st.composite
def plain_configs(draw):
    kind = draw(st.sampled_from(sorted(CLASSES)))
    G = draw(st.sampled_from([1, 2, 4]))
    H = G * draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([4, 8]))
    kw = dict(vocab_size=draw(st.integers(5, 50)), hidden_size=H * (d if kind == "phi3" else draw(st.sampled_from([4, 8]))),
              intermediate_size=draw(st.integers(3, 40)), num_hidden_layers=draw(st.integers(1, 3)),
              num_attention_heads=H, num_key_value_heads=G, tie_word_embeddings=draw(st.booleans()))
    if kind != "phi3":
        kw["head_dim"] = d
    if kind == "llama":
        kw["attention_bias"] = draw(st.booleans())
        kw["mlp_bias"] = draw(st.booleans())
    if kind == "phi3":
        kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config_class, model_class = CLASSES[kind]
    return config_class(**kw), model_class


def _other_kv_heads(c: dict) -> int:
    """Another head count that divides num_attention_heads (itself when there is none)."""
    H, G = c["num_attention_heads"], c["num_key_value_heads"]
    return next((g for g in range(1, H + 1) if H % g == 0 and g != G), G)


# one field moved away from what the weights were built with -> the field named in the one line
PERTURB = {
    "vocab_size": lambda c: c["vocab_size"] + 1,
    "intermediate_size": lambda c: c["intermediate_size"] + 1,
    "num_hidden_layers": lambda c: c["num_hidden_layers"] + 1,
    "num_key_value_heads": _other_kv_heads,
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plain_configs(), st.sampled_from(sorted(PERTURB)))
def test_every_family_matches_transformers_and_a_moved_field_is_named(built, field):
    config, model_class = built
    shapes = _meta_shapes(model_class, config)
    raw = config.to_dict()
    assert shape_problem(with_defaults(raw), shapes) is None
    moved = PERTURB[field](raw)
    if moved == raw[field]:  # MHA with one head: no other head count divides it
        return
    problem = shape_problem(with_defaults({**raw, field: moved}), shapes)
    assert problem is not None and f"{field}={moved}" in problem and "\n" not in problem


@pytest.mark.parametrize("q_lora_rank, bias", [(None, False), (40, False), (33, True)])
def test_deepseek_v3_latent_tensors(q_lora_rank, bias):
    """DEX/DIFF also take DeepSeek-V3 (MLA outputs): q_a/q_b or q_proj, kv_a/kv_b, biases, MoE layers skipped."""
    config = DeepseekV3Config(vocab_size=37, hidden_size=32, intermediate_size=48, moe_intermediate_size=8,
                              num_hidden_layers=3, first_k_dense_replace=2, n_routed_experts=2, num_attention_heads=4,
                              num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=12, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8, attention_bias=bias)
    shapes = _meta_shapes(DeepseekV3ForCausalLM, config)
    raw = config.to_dict()
    assert shape_problem(raw, shapes) is None
    problem = shape_problem({**raw, "kv_lora_rank": 10}, shapes)
    assert "kv_a_proj_with_mqa.weight" in problem and "kv_lora_rank=10" in problem
    no_bias = {k: v for k, v in shapes.items() if not k.endswith("kv_a_proj_with_mqa.bias")}
    assert (shape_problem(raw, no_bias) is None) is (not bias)


def test_tied_and_untied_heads():
    config = LlamaConfig(vocab_size=11, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    shapes = _meta_shapes(LlamaForCausalLM, config)
    without_head = {k: v for k, v in shapes.items() if k != "lm_head.weight"}
    untied, tied = config.to_dict(), {**config.to_dict(), "tie_word_embeddings": True}
    assert "lm_head.weight is missing" in shape_problem(untied, without_head)
    assert "tie_word_embeddings=false" in shape_problem(untied, without_head)
    assert shape_problem(tied, without_head) is None and shape_problem(tied, shapes) is None
    assert "lm_head.weight has shape [12, 16]" in shape_problem(tied, {**shapes, "lm_head.weight": (12, 16)})


def test_a_bias_the_config_has_not_is_named():
    config = LlamaConfig(vocab_size=11, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, attention_bias=True)
    shapes = _meta_shapes(LlamaForCausalLM, config)
    problem = shape_problem({**config.to_dict(), "attention_bias": False}, shapes)
    assert "self_attn.q_proj.bias [16] is present" in problem and "attention_bias=false" in problem


def test_shapes_come_from_the_headers_of_every_shard(tmp_path):
    model, _ = _tiny("llama")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    ckpt = LazyCheckpoint(tmp_path)
    assert len(set(ckpt.weight_map.values())) > 1
    assert ckpt.shapes() == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert ckpt.header()["model.norm.weight"]["dtype"] == "F32"


def _tiny(kind):
    from mla_fixtures import family_model

    return family_model(kind)


# ---------------------------------------------------------------- through the CLI


def _edit_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}, indent=2))


def _drop_tensor(folder: Path, prefix: str) -> None:
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith(prefix)}, folder / "model.safetensors",
              metadata={"format": "pt"})


# defect -> (how to make it, what the one line must say)
DEFECTS = {
    "vocab_size": (lambda f: _edit_config(f, vocab_size=120), ["model.embed_tokens.weight", "[100, 64]", "[120, 64]", "vocab_size=120"]),
    "kv_heads": (lambda f: _edit_config(f, num_key_value_heads=1), ["[16, 64]", "num_key_value_heads=1"]),
    "intermediate_size": (lambda f: _edit_config(f, intermediate_size=80), ["mlp.", "intermediate_size=80"]),
    "missing_layer": (lambda f: _edit_config(f, num_hidden_layers=3), ["layer 2 is missing", "num_hidden_layers=3"]),
    "extra_layer": (lambda f: _edit_config(f, num_hidden_layers=1), ["layer 1", "num_hidden_layers=1"]),
    "untied_no_head": (lambda f: _drop_tensor(f, "lm_head."), ["lm_head.weight is missing", "tie_word_embeddings=false"]),
}
FAMILIES = ["llama", "mistral", "qwen2", "phi3"]  # what `convert --to mla` takes (docs/mla.md, Architectures)
RETROFIT = ["llama", "mistral", "qwen2"]  # what `--to dex|diff` takes besides DeepSeek-V3


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("shape_sources")
    return {kind: save_model(root / kind, kind) for kind in FAMILIES}


def _bad_copy(sources, kind: str, defect: str, tmp_path: Path) -> Path:
    src = tmp_path / f"{kind}-{defect}"
    shutil.copytree(sources[kind], src)
    DEFECTS[defect][0](src)
    return src


def _refused(argv: list[str], src: Path, out: Path, capsys, words: list[str]) -> None:
    before = tree_digest(src)
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in captured.err, captured.err
    for word in words:
        assert word in err[0], (word, err[0])
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))
    assert tree_digest(src) == before


CASES = ([("mla", kind, defect) for kind in FAMILIES for defect in DEFECTS]
         + [(to, kind, defect) for to in ("dex", "diff") for kind in RETROFIT for defect in DEFECTS]
         + [("mla+dex", kind, defect) for kind in FAMILIES for defect in ("vocab_size", "missing_layer")]
         + [("gqa", kind, defect) for kind in FAMILIES for defect in DEFECTS])


@pytest.mark.parametrize("to, kind, defect", CASES)
def test_convert_refuses_weights_its_config_contradicts(sources, calib, tmp_path, capsys, to, kind, defect):
    src = _bad_copy(sources, kind, defect, tmp_path)
    out = tmp_path / "out"
    words = DEFECTS[defect][1] if kind != "phi3" or defect != "kv_heads" else ["qkv_proj", "num_key_value_heads=1"]
    gqa = ["--kv-heads", "1"] if to == "gqa" else []
    _refused(["convert", "--to", to, str(src), "-o", str(out), "--calib", str(calib), *FAST, *gqa], src, out, capsys, words)


def test_a_deepseek_v3_source_is_checked_too(tmp_path, calib, capsys):
    src = tmp_path / "ds"
    DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, first_k_dense_replace=2, n_routed_experts=2, max_position_embeddings=64,
    )).save_pretrained(src)
    _edit_config(src, kv_lora_rank=16)
    out = tmp_path / "out"
    _refused(["convert", "--to", "dex", str(src), "-o", str(out), "--calib", str(calib)], src, out, capsys,
             ["kv_a_proj_with_mqa.weight", "kv_lora_rank=16"])


def test_the_console_script_says_one_line_and_exits_2(sources, tmp_path):
    src = _bad_copy(sources, "qwen2", "vocab_size", tmp_path)
    before = tree_digest(src)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "attnkit.cli", "convert", "--to", "mla", str(src), "-o", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "model.embed_tokens.weight has shape [100, 64], config.json implies [120, 64] (vocab_size=120" in run.stderr
    assert not out.exists() and tree_digest(src) == before


def test_a_consistent_model_still_converts(sources, calib, tmp_path, capsys):
    """mla+dex runs both checked entry points: the MLA driver on the source, the retrofit on its DeepSeek-V3
    output; its own output (attnkit_deepseek_v3) is checked by eval like its source family."""
    out = tmp_path / "out"
    assert main(["convert", "--to", "mla+dex", str(sources["qwen2"]), "-o", str(out), "--calib", str(calib), *FAST]) == 0
    assert json.loads((out / "attnkit_report.json").read_text())["method"] == "mla+dex"
    _edit_config(out, num_hidden_layers=1)
    capsys.readouterr()
    assert main(["eval", str(out), "--tasks", "attnkit-ppl-quick", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a tensor of layer 1, but config num_hidden_layers=1" in err[0]


@pytest.mark.parametrize("command", [["eval", "{src}", "--tasks", "attnkit-ppl-quick", "--limit", "1"],
                                     ["bench", "{src}", "--context", "16", "--decode-tokens", "2", "--repeats", "1"]])
def test_eval_and_bench_name_the_tensor_in_one_line(sources, tmp_path, capsys, command):
    src = _bad_copy(sources, "llama", "vocab_size", tmp_path)
    capsys.readouterr()
    assert main([a.replace("{src}", str(src)) for a in command]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert "Traceback" not in captured.err and len(err) == 1
    assert f"cannot load {src}: model.embed_tokens.weight has shape [100, 64]" in err[0]
