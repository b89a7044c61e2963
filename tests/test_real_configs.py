"""Real configs (tests/data/configs, see SOURCES.md) shrunk to tiny random checkpoints, converted end to end.

Every field of the published config.json is kept except the sizes: RoPE scaling type and values,
max_position_embeddings, tie_word_embeddings, biases, sliding windows, softcapping, query_pre_attn_scalar,
head_dim != hidden / heads where the model has it. Per config: `--to mla` at full size must be exact
(logits relative error < 1e-4), `--to dex --heads all` must be exact at step 0; a family attnkit does not
take must be refused with exit 2, one stderr line and no output folder. Every other method converts each
config too (`test_every_method`): exact where the method is exact at conversion (diff, titans within its
window, mla+dex / mla+titans at MLA's full size), loadable with the cache it promises where it is lossy (gqa).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from attnkit.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from conftest import refused_in_one_line  # noqa: E402
from mla_fixtures import logits_rel, tokenizer  # noqa: E402

CONFIGS = Path(__file__).parent / "data" / "configs"
FAST = ["--calib-tokens", "256", "--calib-seq-len", "32", "--eval-tokens", "64"]
VOCAB = 256
HEAD_DIM = 16
# ids the small tokenizer uses for its special tokens (mla_fixtures.tokenizer: <unk>, <s>, </s>)
SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
DROPPED = ("torch_dtype", "dtype", "transformers_version", "_name_or_path")


def _move_id(value, default: int):
    if value is None:
        return None
    if isinstance(value, list):
        moved = [v if v < VOCAB else default for v in value]
        return list(dict.fromkeys(moved))
    return value if value < VOCAB else default


def tiny_fields(name: str, kv_heads: int | None = None) -> dict:
    """The published config of `name` (file stem) with only its sizes shrunk (to `kv_heads` KV heads, or
    as few as keep 4 query heads), the query/KV head ratio kept."""
    fields = json.loads((CONFIGS / f"{name}.json").read_text())
    for key in DROPPED:
        fields.pop(key, None)
    heads, kv = fields["num_attention_heads"], fields.get("num_key_value_heads") or fields["num_attention_heads"]
    ratio = heads // kv
    n_kv = kv_heads or max(1, 4 // ratio)
    n_q = n_kv * ratio
    explicit_head_dim = fields.get("head_dim") is not None
    decoupled = explicit_head_dim and fields["head_dim"] * heads != fields["hidden_size"]
    if explicit_head_dim:
        fields["head_dim"] = HEAD_DIM
        # keep head_dim * heads != hidden where the model has it (Mistral-Nemo, Gemma-2)
        fields["hidden_size"] = 48 if decoupled else n_q * HEAD_DIM
    else:
        fields["hidden_size"] = n_q * HEAD_DIM  # head_dim derived as hidden / heads, as in the model
    fields.update(num_attention_heads=n_q, num_key_value_heads=n_kv, intermediate_size=96,
                  num_hidden_layers=2, vocab_size=VOCAB)
    if "max_window_layers" in fields:
        fields["max_window_layers"] = min(fields["max_window_layers"], 2)
    if "layer_types" in fields:
        fields["layer_types"] = fields["layer_types"][:2]
    for key, default in SPECIAL.items():
        if key in fields:
            fields[key] = _move_id(fields[key], default)
    rope = fields.get("rope_scaling")
    if isinstance(rope, dict) and "long_factor" in rope:  # Phi-3 longrope: one factor per rotary frequency
        half = int(HEAD_DIM * fields.get("partial_rotary_factor", 1.0)) // 2
        rope["long_factor"] = rope["long_factor"][:half]
        rope["short_factor"] = rope["short_factor"][:half]
    return fields


def build(name: str, folder: Path, seed: int = 0, kv_heads: int | None = None) -> Path:
    fields = tiny_fields(name, kv_heads)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases (zero-initialised otherwise) so that bias handling is tested
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def convert(method: str, src: Path, out: Path, calib: Path, *extra: str) -> int:
    return main(["convert", "--to", method, str(src), "-o", str(out), "--calib", str(calib), *FAST, *extra])


def mla_full_size(src: Path, name: str | None = None) -> list[str]:
    """MLA arguments that keep every K/V dimension (exact): the DeepSeek-V3 form's rank counts one latent-norm
    channel; for a config in NO_NORM_CHANNEL (written in attnkit's format, `name` given) it does not."""
    cfg = AutoConfig.from_pretrained(src)
    G, d = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    R = G * d
    norm_channel = 0 if name in NO_NORM_CHANNEL else 1
    return ["--target", "transformers", "--dtype", "fp32",
            "--kv-lora-rank", str(2 * G * d - R + norm_channel), "--rope-dim", str(R)]


NAMES = sorted(p.stem for p in CONFIGS.glob("*.json"))
# Outcome per config and method. "exact": must convert and match; a tuple: must be refused, in one stderr
# line naming those words. No case crashed or was inexact when this was written, so none is marked xfail.
MLA = {
    "HuggingFaceTB--SmolLM2-135M": "exact",
    "Qwen--Qwen2.5-7B": "exact",
    "Qwen--Qwen2.5-7B-yarn": "exact",
    "Qwen--Qwen3-8B": "exact",
    "google--gemma-2-2b": ("gemma2", "softcapping"),
    "meta-llama--Llama-3.1-8B": "exact",
    "meta-llama--Llama-3.2-1B": "exact",
    "microsoft--Phi-3.5-mini-instruct": ("longrope",),
    "mistralai--Mistral-Nemo-Base-2407": "exact",
}
DEX = {
    "HuggingFaceTB--SmolLM2-135M": "exact",
    "Qwen--Qwen2.5-7B": "exact",
    "Qwen--Qwen2.5-7B-yarn": "exact",
    "Qwen--Qwen3-8B": ("qwen3", "not recognised for DEX"),
    "google--gemma-2-2b": ("gemma2", "not recognised for DEX"),
    "meta-llama--Llama-3.1-8B": "exact",
    "meta-llama--Llama-3.2-1B": "exact",
    "microsoft--Phi-3.5-mini-instruct": ("phi3", "not recognised for DEX"),
    "mistralai--Mistral-Nemo-Base-2407": "exact",
}
# Qwen3 (q/k RMSNorm) is written in attnkit's own MLA format, which has no latent-norm channel: its full
# size is K = 2*G*d - R; the DeepSeek-V3 form of the others counts one norm channel more (K = 2*G*d - R + 1).
NO_NORM_CHANNEL = {"Qwen--Qwen3-8B"}

SIZE_FIELDS = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id",
               "max_window_layers", "layer_types", "dtype", "transformers_version", "_name_or_path"}


def test_configs_present():
    assert set(NAMES) == set(MLA) == set(DEX)
    assert (CONFIGS / "SOURCES.md").is_file()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """name -> tiny checkpoint folder, built on first use and shared by the tests of this module."""
    root, built = tmp_path_factory.mktemp("real"), {}

    def get(name: str, kv_heads: int | None = None) -> Path:
        if (name, kv_heads) not in built:
            built[name, kv_heads] = build(name, root / (name if kv_heads is None else f"{name}-kv{kv_heads}"),
                                           kv_heads=kv_heads)
        return built[name, kv_heads]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_tiny_checkpoint_keeps_every_published_field_but_the_sizes(sources, name):
    published = json.loads((CONFIGS / f"{name}.json").read_text())
    full = AutoConfig.for_model(published.pop("model_type"),
                                **{k: v for k, v in published.items() if k not in DROPPED}).to_dict()
    tiny = AutoConfig.from_pretrained(sources(name)).to_dict()
    for d in (full, tiny):
        for key in SIZE_FIELDS:
            d.pop(key, None)
        rope = d.get("rope_parameters")
        if isinstance(rope, dict) and "long_factor" in rope:  # sliced to head_dim / 2 entries
            factors = tiny["rope_parameters"]
            assert len(factors["long_factor"]) == len(factors["short_factor"]) == HEAD_DIM // 2
            d["rope_parameters"] = {k: v for k, v in rope.items() if k not in ("long_factor", "short_factor")}
    assert tiny == full
    cfg = AutoConfig.from_pretrained(sources(name))
    if name in ("mistralai--Mistral-Nemo-Base-2407", "google--gemma-2-2b"):
        assert cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size


def _case(table: dict, name: str):
    return pytest.param(name, table[name], id=name)


@pytest.mark.parametrize("name, expected", [_case(MLA, n) for n in NAMES])
def test_mla_full_size(sources, calib, tmp_path, capsys, name, expected):
    src, out = sources(name), tmp_path / "out"
    extra = mla_full_size(src)
    if expected != "exact":
        refused_in_one_line(lambda: convert("mla", src, out, calib, *extra), capsys, out, *expected)
        return
    if name in NO_NORM_CHANNEL:
        refused_in_one_line(lambda: convert("mla", src, out, calib, *extra), capsys, out, "--kv-lora-rank")
        k = extra.index("--kv-lora-rank") + 1
        extra[k] = str(int(extra[k]) - 1)
    assert convert("mla", src, out, calib, *extra) == 0
    assert logits_rel(src, out) < 1e-4
    report = json.loads((out / "attnkit_report.json").read_text())
    assert all(s["logits_rel_err_max"] < 1e-4 for s in report["steps"])


@pytest.mark.parametrize("name, expected", [_case(DEX, n) for n in NAMES])
def test_dex_all_heads(sources, calib, tmp_path, capsys, name, expected):
    src, out = sources(name), tmp_path / "out"
    if expected != "exact":
        refused_in_one_line(lambda: convert("dex", src, out, calib, "--heads", "all"), capsys, out, *expected)
        return
    assert convert("dex", src, out, calib, "--heads", "all") == 0
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["steps"][-1]["exact"] is True


# The other methods, per config: "exact" (the written model's logits equal the source's to < 1e-4 and the
# report's last step is exact), "lossy" (converted, loads, fewer KV heads, finite logits) or refusal words.
RETROFITS = ("diff", "titans", "mla+dex", "mla+titans")
REFUSED_RETROFIT = {"Qwen--Qwen3-8B": ("qwen3", "not recognised"), "google--gemma-2-2b": ("gemma2", "not recognised"),
                    "microsoft--Phi-3.5-mini-instruct": ("phi3", "not recognised")}
OTHERS = {(name, method): REFUSED_RETROFIT.get(name, "exact") for name in NAMES for method in RETROFITS}
OTHERS.update({(name, method): MLA[name] for name in NAMES for method in ("mla+dex", "mla+titans")
               if MLA[name] != "exact"})  # refused by their MLA step, in its words
OTHERS.update({("Qwen--Qwen3-8B", m): ("qwen3", "q/k norms", "--format deepseek_v3") for m in ("mla+dex", "mla+titans")})
OTHERS.update({(name, "gqa"): "lossy" for name in NAMES})
OTHERS.update({("google--gemma-2-2b", "gqa"): ("gemma2",), ("Qwen--Qwen3-8B", "gqa"): ("qwen3", "to GQA")})
EXTRA = {"diff": [], "titans": ["--window", "64"], "mla+dex": [], "mla+titans": ["--window", "64"],
         "gqa": ["--kv-heads", "1"]}


@pytest.mark.parametrize("name, method, expected",
                         [pytest.param(n, m, OTHERS[n, m], id=f"{n}-{m}") for n, m in sorted(OTHERS)])
def test_every_method(sources, calib, tmp_path, capsys, name, method, expected):
    src, out = sources(name, kv_heads=2 if method == "gqa" else None), tmp_path / "out"
    extra = (mla_full_size(src, name) if method.startswith("mla") else []) + EXTRA[method]
    if expected not in ("exact", "lossy"):
        refused_in_one_line(lambda: convert(method, src, out, calib, *extra), capsys, out, *expected)
        return
    assert convert(method, src, out, calib, *extra) == 0
    report = json.loads((out / "attnkit_report.json").read_text())
    if expected == "exact":
        assert report["steps"][-1]["exact"] is True and logits_rel(src, out) < 1e-4
        return
    assert AutoConfig.from_pretrained(out).num_key_value_heads == 1
    assert all(torch.isfinite(torch.tensor(s["logits_rel_err_max"])) for s in report["steps"])
    assert logits_rel(src, out) < 1.0  # finite: the comparison itself fails on NaN or inf
