"""--kv-budget: candidate splits, per-layer allocation arithmetic, option errors and the end-to-end choice."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attnkit.cli import main
from attnkit.converters.mla.layer import Shape
from attnkit.converters.mla.budget import (KL_TIE, allocate_ranks, budget_values, max_rank, preferred, refine_candidates,
                                          split_candidates)


@settings(max_examples=30, deadline=None)
@given(G=st.sampled_from([1, 2, 8]), d=st.sampled_from([16, 64, 128]), frac=st.floats(0.05, 1.0),
       geometric=st.booleans())
def test_candidates_fit_the_budget(G, d, frac, geometric):
    shape = Shape(4 * G * d // 4, 4 * G, G, d)
    total = budget_values(shape, frac)
    cap = d if geometric else G * d
    cands = split_candidates(shape, total, cap)
    assert total <= frac * 2 * G * d + 1e-6
    for rank, dr in cands:
        assert dr % 2 == 0 and 2 <= dr <= cap and 2 <= rank <= max_rank(shape, dr) and rank + dr <= total
    assert len({dr for _, dr in cands}) == len(cands)
    if total >= 4:
        assert cands, "a budget of 4+ values always has a candidate"
        tried = [dr for _, dr in cands]
        for rank, dr in refine_candidates(shape, total, tried, tried[len(tried) // 2], cap):
            assert dr not in tried and dr % 2 == 0 and rank + dr <= total and rank <= max_rank(shape, dr)


def test_allocation_sums_to_the_total_and_follows_the_gains():
    flat, steep = torch.ones(20), torch.tensor([2.0**-k for k in range(20)])
    ranks = allocate_ranks([steep, flat], 24, 2, 21, relative=False)
    assert sum(ranks) == 24 and ranks[1] > ranks[0] and all(2 <= r <= 21 for r in ranks)
    # relative gains: a layer with 10x the energy but the same shape gets the same rank
    ranks = allocate_ranks([10 * steep, steep], 20, 2, 21, relative=True)
    assert ranks[0] == ranks[1] == 10
    assert allocate_ranks([steep, flat], 4, 2, 21) == [2, 2]


def _convert(tmp_path, *extra):
    return main(["convert", "--to", "mla", "reference", "-o", str(tmp_path / "out"), *extra])


def test_budget_with_explicit_ranks_is_a_one_line_error(tmp_path, capsys):
    assert _convert(tmp_path, "--kv-budget", "0.3", "--kv-lora-rank", "28") == 2
    err = capsys.readouterr().err.strip()
    assert "--kv-budget" in err and "\n" not in err and not (tmp_path / "out").exists()
    for bad in ("0", "1.5", "-0.2", "0.01"):
        assert _convert(tmp_path, "--kv-budget", bad) == 2
        assert "--kv-budget" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["engines", "transformers"])  # transformers: exact frequencies, loss scores,
def test_budget_conversion_chooses_a_split_within_the_budget(tmp_path, capsys, target):  # candidates past head_dim
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from mla_fixtures import calib_folder, save_model

    src = save_model(tmp_path / "src", "llama")  # G 2, d 16: 64 cached values per token and layer
    calib = calib_folder(tmp_path / "calib")
    out = tmp_path / "out"
    assert main(["convert", "--to", "mla", str(src), "-o", str(out), "--calib", str(calib), "--calib-tokens", "256",
                 "--calib-seq-len", "32", "--eval-tokens", "64", "--kv-budget", "0.5", "--target", target]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "attnkit_report.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    b = report["kv_budget"]
    assert b["values_per_token_layer"] == 32 and len(b["candidates"]) >= 3
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (b["chosen"]["kv_lora_rank"], b["chosen"]["rope_dim"])
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] <= 32 and report["kv_cache_fraction"] <= 0.5
    best = preferred(b["candidates"])[0]
    assert (best["kv_lora_rank"], best["rope_dim"]) == (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"])
    assert b["kl_tie"] == KL_TIE and best["kl"] <= (1 + KL_TIE) * min(c["kl"] for c in b["candidates"])
    assert "<- chosen" in printed and "--kv-budget 0.5: chose" in printed
    assert not list(tmp_path.glob("attnkit-scratch-*"))  # the candidates' scratch folder is gone
    # the chosen split converts to the same weights when named explicitly (the RoPE pre-pass is reused, not redone differently)
    from safetensors.torch import load_file

    explicit = tmp_path / "explicit"
    assert main(["convert", "--to", "mla", str(src), "-o", str(explicit), "--calib", str(calib), "--calib-tokens", "256",
                 "--calib-seq-len", "32", "--eval-tokens", "64", "--kv-lora-rank", str(cfg["kv_lora_rank"]),
                 "--rope-dim", str(cfg["qk_rope_head_dim"]), "--target", target]) == 0
    for shard in ("model-layers.safetensors", "model-embeddings.safetensors"):
        a, e = load_file(str(out / shard)), load_file(str(explicit / shard))
        assert a.keys() == e.keys() and all(torch.equal(a[k], e[k]) for k in a), shard


def test_engine_sizes_refusals_are_one_line(tmp_path, capsys):
    # the reference caches 2 x 2 x 64 = 256 values: no vLLM MLA size (320/512/576) is a compression of it
    assert _convert(tmp_path, "--kv-budget", "0.9", "--engine-sizes", "vllm") == 2
    err = capsys.readouterr().err.strip()
    assert "no split vllm's MLA kernels take fits --kv-budget 0.9" in err and "\n" not in err
    for extra in (["--engine-sizes", "vllm", "--kv-lora-rank", "28", "--rope-dim", "48"],
                  ["--kv-budget", "0.5", "--engine-sizes", "vllm", "--target", "transformers"]):
        assert _convert(tmp_path, *extra) == 2
        assert "--engine-sizes" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("sizes, budget, chosen", [("vllm", 0.6, None), ("vllm-cpu", 0.6, (512, 64))])
def test_engine_sizes_choose_among_what_vllm_takes(tmp_path, sizes, budget, chosen):
    """An MHA source of 8 x 64 (1,024 cached values): at 60 % (614), vLLM's sizes that fit are 576, 512 and
    320; the CPU backends take 576 only."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from mla_fixtures import calib_folder, save_model

    src = save_model(tmp_path / "src", "mha", hidden_size=128, num_attention_heads=8, num_key_value_heads=8, head_dim=64)
    calib = calib_folder(tmp_path / "calib")
    out = tmp_path / "out"
    assert main(["convert", "--to", "mla", str(src), "-o", str(out), "--calib", str(calib), "--calib-tokens", "256",
                 "--calib-seq-len", "32", "--eval-tokens", "64", "--kv-budget", str(budget), "--engine-sizes", sizes,
                 "--report", "final"]) == 0
    report = json.loads((out / "attnkit_report.json").read_text())
    tried = {(c["kv_lora_rank"], c["rope_dim"]) for c in report["kv_budget"]["candidates"]}
    assert tried == ({(512, 64), (448, 64), (256, 64)} if sizes == "vllm" else {(512, 64)})
    best = preferred(report["kv_budget"]["candidates"])[0]
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (best["kv_lora_rank"], best["rope_dim"])
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] in (320, 512, 576)
    if sizes == "vllm-cpu":
        assert report["serving"]["vLLM CPU"].startswith("yes") and (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == chosen


def test_choose_by_heal_needs_a_budget_and_a_recipe(tmp_path, capsys):
    for extra in (["--choose-by", "heal", "--kv-lora-rank", "28", "--rope-dim", "48"],
                  ["--kv-budget", "0.3", "--choose-by", "heal", "--heal-recipe", str(tmp_path / "none.yaml")]):
        assert _convert(tmp_path, *extra) == 2
        err = capsys.readouterr().err.strip()
        assert "--choose-by heal" in err or "--heal-recipe" in err, err
        assert "\n" not in err and not (tmp_path / "out").exists()


def test_finalists_are_the_preferred_rows():
    from attnkit.converters.mla.heal_choice import finalists

    rows = [{"rope_dim": d, "kl": kl} for d, kl in ((2, 1.3), (40, 0.1532), (52, 0.15049), (64, 0.15061), (26, 0.35))]
    assert [r["rope_dim"] for r in finalists(rows, 3)] == [64, 52, 40]  # 52 and 64 tied: the wider first
    assert [r["rope_dim"] for r in finalists(rows, 9)] == [64, 52, 40, 26, 2]


@settings(max_examples=60, deadline=None)
@given(kls=st.lists(st.floats(1e-4, 10.0), min_size=1, max_size=9), tie=st.sampled_from([0.0, 0.01, 0.1]))
def test_preferred_takes_the_widest_of_the_ties_then_orders_by_kl(kls, tie):
    rows = [{"rope_dim": 2 * (i + 1), "kl": kl} for i, kl in enumerate(kls)]
    order = preferred(rows, tie)
    least = min(kls)
    tied = [r for r in rows if r["kl"] <= least * (1 + tie)]
    assert sorted(map(id, order)) == sorted(map(id, rows))
    assert order[: len(tied)] == sorted(tied, key=lambda r: -r["rope_dim"])  # every tie first, widest first
    rest = [r["kl"] for r in order[len(tied):]]
    assert rest == sorted(rest) and all(k > least * (1 + tie) for k in rest)
    if tie == 0.0:
        assert order[0]["kl"] == least  # no tolerance: the least KL, as before


@pytest.mark.slow
def test_choose_by_heal_writes_the_finalist_that_healed_best(tmp_path, capsys):
    """Every finalist converted and healed briefly; OUT holds the one with the lowest validation loss, and
    equals that split's plain conversion (the other finalists and the short heals leave nothing behind)."""
    import json

    from safetensors.torch import load_file

    out, common, src = tmp_path / "out", *_heal_choice_setup(tmp_path)
    best = _convert_choosing_by_heal(tmp_path, "mla", src, out, common, capsys)
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["kv_budget"]["chosen"] == {"kv_lora_rank": best["kv_lora_rank"], "rope_dim": best["rope_dim"]}
    assert report["kv_budget"]["chosen_by"] == "heal" and len(report["kv_budget"]["candidates"]) >= 3
    explicit = tmp_path / "explicit"
    assert main(["convert", "--to", "mla", str(src), "-o", str(explicit), *common, "--kv-lora-rank",
                 str(best["kv_lora_rank"]), "--rope-dim", str(best["rope_dim"])]) == 0
    a, e = load_file(str(out / "model-layers.safetensors")), load_file(str(explicit / "model-layers.safetensors"))
    assert a.keys() == e.keys() and all(torch.equal(a[k], e[k]) for k in a)


@pytest.mark.slow
def test_choose_by_heal_in_a_composite_picks_the_mla_step_split(tmp_path, capsys):
    """`--to mla+dex --kv-budget F --choose-by heal`: the MLA step's finalists are healed with the recipe, DEX
    runs on the one that healed best, and the composite's report keeps the MLA step's choice."""
    import json

    out, common, src = tmp_path / "out", *_heal_choice_setup(tmp_path)
    best = _convert_choosing_by_heal(tmp_path, "mla+dex", src, out, [*common, "--heads", "all"], capsys)
    report = json.loads((out / "attnkit_report.json").read_text())
    assert report["method"] == "mla+dex" and report["mla"]["kv_budget"]["chosen_by"] == "heal"
    assert json.loads((out / "config.json").read_text())["model_type"] == "attnkit_deepseek_v3"


def _heal_choice_setup(tmp_path):
    """A tiny Llama (G 2, d 16: 64 cached values per token and layer), its calibration text and a short
    healing recipe on it (`heal.yaml`); returns the convert arguments they need and the source folder."""
    import sys
    from pathlib import Path

    import yaml

    sys.path.insert(0, str(Path(__file__).parent))
    from mla_fixtures import calib_folder, save_model

    src = save_model(tmp_path / "src", "llama")
    calib = calib_folder(tmp_path / "calib")
    recipe = tmp_path / "heal.yaml"
    recipe.write_text(yaml.safe_dump({
        "data": {"source": str(calib), "seq_len": 32, "tokens": 32 * 40, "val_tokens": 128},
        "train": {"trainable": "new", "patterns": [r"self_attn\.kv_", r"self_attn\.q_"], "per_device_batch_size": 1,
                  "lr": 1e-3, "warmup_steps": 1, "mixed_precision": "no"},
        "loss": {"ce_weight": 1.0, "kl_weight": 0.0, "hidden_weight": 30.0}, "log": {"tensorboard": False}}))
    common = ["--calib", str(calib), "--calib-tokens", "256", "--calib-seq-len", "32", "--eval-tokens", "64"]
    return common, src


def _convert_choosing_by_heal(tmp_path, to, src, out, common, capsys) -> dict:
    """Convert with `--kv-budget 0.5 --choose-by heal` (2 finalists, 2 steps each); check that OUT holds the
    finalist of least validation loss and that nothing else was left behind; return that finalist."""
    import json

    assert main(["convert", "--to", to, str(src), "-o", str(out), *common, "--kv-budget", "0.5", "--choose-by", "heal",
                 "--heal-recipe", str(tmp_path / "heal.yaml"), "--heal-steps", "2", "--heal-candidates", "2"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "attnkit_report.json").read_text())
    choice = report.get("mla", report)["kv_budget"]["heal_choice"]
    assert len(choice["finalists"]) == 2 and choice["steps"] == 2
    best = min(choice["finalists"], key=lambda f: f["heal_validation_loss"])
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (best["kv_lora_rank"], best["rope_dim"])
    assert "--choose-by heal: chose" in printed and not (out / ".choose-by-heal").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib", "heal.yaml", "out", "src"]
    return best
