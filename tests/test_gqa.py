"""`attnkit convert --to gqa`: the alignment is exact, N = G is the source, heads that are copies up to
an alignment merge exactly (grouping by similarity, query reordering), every family's output loads
with plain transformers, bad input is one line and exit 2."""

import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from attnkit.adapters.families import FAMILIES
from attnkit.cli import main
from attnkit.converters.gqa import math as gm
from attnkit.converters.gqa.convert import attention_tensors
from attnkit.converters.mla.layer import AttnWeights, Shape

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import family_model, save_model  # noqa: E402
from conftest import refused_in_one_line, tree_digest  # noqa: E402

FAST = ["--calib-tokens", "256", "--calib-seq-len", "32", "--eval-tokens", "128"]
KINDS = ["llama", "mistral", "qwen2", "phi3"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("gqa_sources")
    out = {kind: save_model(root / kind, kind) for kind in KINDS}
    out["mha"] = save_model(root / "mha", "mha")  # 4 KV heads
    return out


# ---------------------------------------------------------------- the math on models in memory


def _weights(model, kind: str, layer: int) -> tuple[AttnWeights, Shape]:
    cfg = model.config
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    attn = model.model.layers[layer].self_attn
    fam = FAMILIES[cfg.model_type]
    if len(fam.qkv) == 1:
        w = attn.qkv_proj.weight.detach()
        wq, wk, wv = w.split([H * d, G * d, G * d])
        bq = bk = bv = None
    else:
        wq, wk, wv = attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach()
        bq, bk, bv = (None if p.bias is None else p.bias.detach() for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    o = attn.o_proj
    return AttnWeights(wq, wk, wv, o.weight.detach(), bq, bk, bv, None if o.bias is None else o.bias.detach()), Shape(cfg.hidden_size, H, G, d)


def _set(model, layer: int, aw: AttnWeights) -> None:
    fam = FAMILIES[model.config.model_type]
    state = {k: v.float() for k, v in attention_tensors(aw, fam).items()}
    model.model.layers[layer].self_attn.load_state_dict(state, strict=True)


def _moment(D: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, D, generator=g, dtype=torch.float64) @ torch.randn(D, D, generator=g, dtype=torch.float64) / D**0.5
    x = torch.cat([x + 0.3, torch.ones(512, 1, dtype=torch.float64)], 1)
    return x.T @ x / 512


def _logits(model, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def _rel(a, b) -> float:
    return float((a - b).norm() / a.norm())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), heads=st.sampled_from([(4, 2), (4, 4), (8, 2), (6, 3), (4, 1)]),
       d=st.sampled_from([8, 16]), bias=st.booleans(), scale=st.booleans(), seed=st.integers(0, 1000))
def test_alignment_alone_is_exact(kind, heads, d, bias, scale, seed):
    """Rotations per RoPE pair (and scales) folded into the queries, orthogonal value maps folded into
    o_proj: the logits do not move (fp32), whatever the grouping."""
    H, G = heads
    over = dict(num_attention_heads=H, num_key_value_heads=G, hidden_size=H * d)
    if kind != "phi3":
        over["head_dim"] = d
    if kind == "llama":
        over["attention_bias"] = bias
    model, _ = family_model(kind, seed=seed, **over)
    before = _logits(model)
    for layer in range(model.config.num_hidden_layers):
        aw, shape = _weights(model, kind, layer)
        h = gm.split_heads(aw, shape)
        mom = _moment(shape.D, seed + layer)
        groups = gm.choose_groups(gm.pair_costs(h, mom), max(1, G // 2))
        _set(model, layer, gm.join_heads(gm.align_all(h, groups, mom, scale)))
    assert _rel(before, _logits(model)) < 1e-5


def _rotated_copies(model, layer: int, pairs_of: dict[int, int], seed: int) -> None:
    """KV head b := head a under a random RoPE-pair rotation (keys) and orthogonal map (values)."""
    aw, shape = _weights(model, "llama", layer)
    h = gm.split_heads(aw, shape)
    g = torch.Generator().manual_seed(seed)
    for b, a in pairs_of.items():
        rot = gm.rotation(torch.rand(shape.d // 2, generator=g, dtype=torch.float64) * 6.28)
        h.k[b] = gm.unpairs(torch.einsum("ipq,iqc->ipc", rot, gm.pairs(h.k[a])))
        q, _ = torch.linalg.qr(torch.randn(shape.d, shape.d, generator=g, dtype=torch.float64))
        h.v[b] = q @ h.v[a]
    _set(model, layer, gm.join_heads(h))


def test_copies_up_to_alignment_merge_exactly_and_are_found_by_similarity(tmp_path):
    """KV heads {0, 2} and {1, 3} are copies of each other up to an alignment: the similarity grouping
    pairs them (not by index), and the aligned merge is exact, so query heads were reordered right."""
    model, _ = family_model("llama", num_attention_heads=8, num_key_value_heads=4, head_dim=8, hidden_size=64,
                            attention_bias=True)
    for layer in range(model.config.num_hidden_layers):
        _rotated_copies(model, layer, {2: 0, 3: 1}, layer)
    before = _logits(model)
    for layer in range(model.config.num_hidden_layers):
        aw, shape = _weights(model, "llama", layer)
        stages, info = gm.convert_layer(aw, shape, 2, "aligned", _moment(shape.D, layer))
        assert info["groups"] == [[0, 2], [1, 3]]
        _set_merged(model, layer, stages["merge"], 2)
    assert _rel(before, _logits(model)) < 1e-5
    # the plain mean of contiguous heads is not exact on the same model
    model2, _ = family_model("llama", num_attention_heads=8, num_key_value_heads=4, head_dim=8, hidden_size=64,
                             attention_bias=True)
    for layer in range(model2.config.num_hidden_layers):
        _rotated_copies(model2, layer, {2: 0, 3: 1}, layer)
        aw, shape = _weights(model2, "llama", layer)
        _set_merged(model2, layer, gm.convert_layer(aw, shape, 2, "mean", None)[0]["merge"], 2)
    assert _rel(before, _logits(model2)) > 1e-2


def _set_merged(model, layer: int, aw: AttnWeights, n_kv: int) -> None:
    attn = model.model.layers[layer].self_attn
    d = attn.head_dim
    for name in ("k_proj", "v_proj"):
        lin = getattr(attn, name)
        new = torch.nn.Linear(lin.in_features, n_kv * d, bias=lin.bias is not None)
        setattr(attn, name, new)
    attn.num_key_value_groups = attn.config.num_attention_heads // n_kv
    _set(model, layer, aw)


def test_choose_groups_greedy_matches_exhaustive_on_a_planted_grouping(monkeypatch):
    g = torch.Generator().manual_seed(0)
    labels = torch.randperm(12, generator=g) % 4  # 4 groups of 3
    cost = torch.rand(12, 12, generator=g, dtype=torch.float64) + 1.0
    cost = (cost + cost.T) / 2
    cost[labels[:, None] == labels[None, :]] = 0.01
    want = sorted(sorted(int(i) for i in torch.nonzero(labels == c)) for c in range(4))
    assert gm.choose_groups(cost, 4) == want  # exhaustive (15400 partitions)
    monkeypatch.setattr(gm, "MAX_PARTITIONS", 10)
    assert gm.choose_groups(cost, 4) == want  # greedy + swaps


# ---------------------------------------------------------------- the command


def _convert(src, out, calib, *extra):
    return main(["convert", "--to", "gqa", str(src), "-o", str(out), "--calib", str(calib), *FAST, *extra])


@pytest.mark.parametrize("kind", ["llama", "mha"])
def test_n_equal_to_the_source_heads_is_the_source_bit_for_bit(sources, calib, tmp_path, kind):
    src = sources[kind]
    n = json.loads((src / "config.json").read_text())["num_key_value_heads"]
    assert _convert(src, tmp_path / "out", calib, "--kv-heads", str(n)) == 0
    a, b = load_file(src / "model.safetensors"), _all(tmp_path / "out")
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    report = json.loads((tmp_path / "out" / "attnkit_report.json").read_text())
    assert report["kv_cache_fraction"] == 1.0 and report["steps"] == []


def _all(folder: Path) -> dict:
    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("merge", ["aligned", "mean"])
def test_every_family_converts_and_loads_plainly(sources, calib, tmp_path, kind, merge, capsys):
    src = sources[kind]
    before = tree_digest(src)
    out = tmp_path / "out"
    assert _convert(src, out, calib, "--kv-heads", "1", "--merge", merge) == 0
    assert "KV cache: " in capsys.readouterr().out
    assert tree_digest(src) == before
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == FAMILIES[kind].prefix + "ForCausalLM"
    assert model.config.num_key_value_heads == 1
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["method"] == "gqa" and report["kv_cache_fraction"] == 0.5
    kv = report["kv_cache_bytes_per_token"]
    assert kv["after"] * 2 == kv["before"]
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == (["align", "merge", "refit"] if merge == "aligned" else ["merge"])
    if merge == "aligned":
        assert steps["align"]["exact"] and steps["align"]["logits_rel_err_max"] < 1e-4
    # the report's last step is the model written: its held-out perplexity is what the output gives
    final = report["steps"][-1]
    assert final["ppl"] == report["ppl"]["after"] and final["kl"] >= 0
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    assert _rel(_logits(ref), _logits(model)) < 2.0  # runs and is the same kind of function
    if merge == "mean" and kind == "llama":  # the layout: k_proj is the mean of the source's KV heads
        a, b = load_file(src / "model.safetensors"), _all(out)
        k = a["model.layers.0.self_attn.k_proj.weight"]
        assert torch.allclose(b["model.layers.0.self_attn.k_proj.weight"], k.reshape(2, -1, k.shape[1]).mean(0), atol=1e-6)


def test_the_written_model_is_the_reports_last_step(sources, calib, tmp_path):
    """The output's perplexity on the report's held-out rows equals the report's `after` (fp32 source)."""
    from attnkit.converters.common import calibration_tokens
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    assert _convert(sources["llama"], out, calib, "--kv-heads", "1") == 0
    report = json.loads((out / "attnkit_report.json").read_text())
    tok = AutoTokenizer.from_pretrained(out)
    _, held, _ = calibration_tokens(tok, str(calib), 32, 256, 128, 0)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        loss = model(held, labels=held).loss
    assert abs(float(torch.exp(loss)) / report["ppl"]["after"] - 1) < 1e-3


def _refused(argv, src, out, capsys, words):
    before = tree_digest(src)
    refused_in_one_line(lambda: main(argv), capsys, out, *words)
    assert not list(out.parent.glob(f".{out.name}*"))
    assert tree_digest(src) == before


@pytest.mark.parametrize("extra, words", [
    ([], ["needs --kv-heads"]),
    (["--kv-heads", "3"], ["--kv-heads 3 does not divide", "4 KV heads"]),
    (["--kv-heads", "8"], ["--kv-heads must be in 1..4"]),
    (["--kv-heads", "0"], ["--kv-heads must be in 1..4"]),
])
def test_bad_kv_heads_are_one_line(sources, calib, tmp_path, capsys, extra, words):
    out = tmp_path / "out"
    _refused(["convert", "--to", "gqa", str(sources["mha"]), "-o", str(out), "--calib", str(calib), *FAST, *extra],
             sources["mha"], out, capsys, words)


def test_unsupported_family_is_one_line(sources, calib, tmp_path, capsys):
    import shutil

    src = tmp_path / "qwen3"
    shutil.copytree(sources["llama"], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "qwen3"}))
    out = tmp_path / "out"
    _refused(["convert", "--to", "gqa", str(src), "-o", str(out), "--calib", str(calib), *FAST, "--kv-heads", "1"],
             src, out, capsys, ["model_type 'qwen3'", "supported are llama, mistral, phi3, qwen2"])


def test_a_sliding_window_shorter_than_the_rows_is_refused_and_a_longer_one_kept(tmp_path, calib, capsys):
    short = save_model(tmp_path / "short", "mistral", sliding_window=16)
    out = tmp_path / "out"
    _refused(["convert", "--to", "gqa", str(short), "-o", str(out), "--calib", str(calib), *FAST, "--kv-heads", "1"],
             short, out, capsys, ["sliding window of 16 tokens", "--calib-seq-len <= 16"])
    long = save_model(tmp_path / "long", "mistral", sliding_window=64)
    assert _convert(long, out, calib, "--kv-heads", "1") == 0
    assert json.loads((out / "config.json").read_text())["sliding_window"] == 64
    assert json.loads((out / "attnkit_report.json").read_text())["target"]["sliding_window"] == 64


# ---------------------------------------------------------------- healing with the shipped recipe


def test_heal_gqa_recipe_runs_end_to_end_and_trains_only_the_attention(sources, calib, tmp_path):
    from attnkit.training.finetune import run
    from attnkit.training.recipe import load_finetune_recipe

    student = tmp_path / "mqa"
    assert _convert(sources["qwen2"], student, calib, "--kv-heads", "1") == 0
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "heal-gqa.yaml"
    out = tmp_path / "healed"
    overrides = [f"model={student}", f"output_dir={out}", f"data.source={calib}", "data.seq_len=16",
                 "data.tokens=384", "data.val_tokens=64", "train.per_device_batch_size=4", "train.warmup_steps=1",
                 "train.lr=1e-2", "train.mixed_precision='no'", "eval.every=3", "eval.tasks=null", "checkpoint.every=100"]
    report = run(load_finetune_recipe(recipe, overrides))
    assert report["steps"] == 6
    before, after = _all(student), _all(out)
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert changed and all(".self_attn." in k for k in changed)
    assert {k.rsplit(".", 2)[-2] for k in changed} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    saved = json.loads((out / "finetune_report.json").read_text())
    assert saved["trainable"].startswith("attention: ")
    assert Path(saved["teacher"]).name == sources["qwen2"].name and not Path(saved["teacher"]).is_absolute()
    assert saved["eval_after"]["validation"]["loss"] < saved["eval_before"]["validation"]["loss"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.num_key_value_heads == 1
