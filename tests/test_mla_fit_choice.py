"""`--choose-by fit` (attnkit.converters.mla.fit_choice): the walk along rope_dim, its refusals, and the
end-to-end choice (OUT is the split of least fitted KL, byte for byte its explicit conversion)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attnkit.cli import main
from attnkit.converters.mla.choice import Tried
from attnkit.converters.mla.fit_choice import next_split, walk_step

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import calib_folder, save_model  # noqa: E402
from conftest import refused_in_one_line  # noqa: E402

FAST = ["--calib-tokens", "512", "--calib-seq-len", "32", "--eval-tokens", "128"]


def _walk(budget: dict, kl, limit: int) -> list[Tried]:
    """Run the walk against a made-up fitted KL per rope_dim."""
    tried: list[Tried] = []
    while (split := next_split(budget, tried, limit)) is not None:
        tried.append(Tried(split, kl(split[1])))
    return tried


def _budget(rank: int, rope: int, widest: int) -> dict:
    return {"chosen": {"kv_lora_rank": rank, "rope_dim": rope},
            "candidates": [{"kv_lora_rank": rank + rope - d, "rope_dim": d, "kl": 1.0} for d in (2, rope, widest)]}


def test_the_walk_on_the_check_models_measured_fits():
    """reference-c's and the reference's fitted KL at --fit-steps 200 (docs/finetune.md): the walk stops at
    26/12 after 4 conversions on the one, keeps 36/40 after 3 on the other."""
    c = {20: 0.0720, 16: 0.0549, 12: 0.0527, 8: 0.1090, 24: 0.09}
    tried = _walk(_budget(18, 20, 32), c.__getitem__, limit=6)
    assert [t.split for t in tried] == [(18, 20), (22, 16), (26, 12), (30, 8)]
    ref = {40: 0.0131, 32: 0.0150, 48: 0.0140}
    tried = _walk(_budget(36, 40, 64), ref.__getitem__, limit=6)
    assert [t.split for t in tried] == [(36, 40), (44, 32), (28, 48)]
    assert _walk(_budget(18, 20, 32), c.__getitem__, limit=2)[-1].split == (22, 16)  # the cap holds


@settings(max_examples=60, deadline=None)
@given(rank=st.integers(2, 300), rope=st.integers(1, 40).map(lambda k: 2 * k), extra=st.integers(0, 40),
       limit=st.integers(1, 8), kls=st.lists(st.floats(1e-4, 5.0), min_size=81, max_size=81))
def test_the_walk_keeps_the_cache_size_and_ends_at_a_local_least(rank, rope, extra, limit, kls):
    widest = rope + 2 * extra
    budget = _budget(rank, rope, widest)
    tried = _walk(budget, lambda d: kls[d // 2], limit)
    assert tried[0].split == (rank, rope) and len(tried) <= limit
    assert len({t.split for t in tried}) == len(tried)
    for t in tried:
        assert sum(t.split) == rank + rope and t.split[0] >= 2 and 2 <= t.split[1] <= widest and t.split[1] % 2 == rope % 2
    if len(tried) < limit:  # it stopped on its own: every neighbour in range of the best was tried and is no better
        best = min(tried, key=lambda t: t.score)
        step, seen = walk_step(rope), {t.split[1]: t.score for t in tried}
        for d in (best.split[1] - step, best.split[1] + step):
            if 2 <= d <= widest and rank + rope - d >= 2:
                assert seen[d] >= best.score


def test_choose_by_fit_refuses_in_one_line(tmp_path, capsys):
    src = save_model(tmp_path / "src", "llama")
    out = tmp_path / "out"
    for bad, words in ((["--choose-by", "fit", "--fit-steps", "5", "--kv-lora-rank", "20", "--rope-dim", "8"],
                        ["--choose-by fit", "--kv-budget"]),
                       (["--choose-by", "fit", "--kv-budget", "0.5"], ["--choose-by fit", "--fit-steps"]),
                       (["--choose-by", "fit", "--kv-budget", "0.5", "--fit-steps", "5", "--engine-sizes", "vllm"],
                        ["--engine-sizes"]),
                       (["--kv-budget", "0.5", "--fit-steps", "5", "--fit-candidates", "0"], ["--fit-candidates"])):
        refused_in_one_line(lambda: main(["convert", "--to", "mla", str(src), "-o", str(out), *FAST, *bad]),  # noqa: B023
                            capsys, out, *words)


@pytest.mark.slow
def test_choose_by_fit_writes_the_split_of_least_fitted_kl(tmp_path, capsys):
    """`--kv-budget 0.5 --fit-steps N` (auto = fit): every split the walk tried is in the report with its fitted
    KL; OUT holds the least, equal to that split converted by name with the same fit; nothing else is left."""
    from safetensors.torch import load_file

    src, calib = save_model(tmp_path / "src", "llama"), calib_folder(tmp_path / "calib")
    common = ["--calib", str(calib), *FAST, "--fit-steps", "6", "--report", "final"]
    out = tmp_path / "out"
    assert main(["convert", "--to", "mla", str(src), "-o", str(out), *common, "--kv-budget", "0.5",
                 "--fit-candidates", "3"]) == 0
    printed = capsys.readouterr().out
    budget = json.loads((out / "attnkit_report.json").read_text())["kv_budget"]
    tried = budget["fit_choice"]["finalists"]
    assert budget["chosen_by"] == "fit" and 2 <= len(tried) <= 3 and budget["fit_choice"]["fit_steps"] == 6
    assert (tried[0]["kv_lora_rank"], tried[0]["rope_dim"]) == tuple(budget["kl_chosen"].values())
    best = min(tried, key=lambda t: t["fitted_kl"])
    assert budget["chosen"] == {"kv_lora_rank": best["kv_lora_rank"], "rope_dim": best["rope_dim"]}
    assert len({t["kv_lora_rank"] + t["rope_dim"] for t in tried}) == 1
    assert "--choose-by fit: chose" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib", "out", "src"]
    explicit = tmp_path / "explicit"
    assert main(["convert", "--to", "mla", str(src), "-o", str(explicit), *common, "--kv-lora-rank",
                 str(best["kv_lora_rank"]), "--rope-dim", str(best["rope_dim"])]) == 0
    a, e = load_file(str(out / "model-layers.safetensors")), load_file(str(explicit / "model-layers.safetensors"))
    assert a.keys() == e.keys() and all(torch.equal(a[k], e[k]) for k in a)
    kl_only = tmp_path / "kl"
    assert main(["convert", "--to", "mla", str(src), "-o", str(kl_only), *common, "--kv-budget", "0.5",
                 "--choose-by", "kl"]) == 0
    assert "chosen_by" not in json.loads((kl_only / "attnkit_report.json").read_text())["kv_budget"]
