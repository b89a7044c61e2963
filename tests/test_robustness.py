"""The four robustness measures (attnkit/evaluation/robustness.py) and the distractor tasks' data, on
tiny random models: plain Llama and its DEX/DIFF retrofits in memory."""

from __future__ import annotations

import json

import pytest
import torch
from test_dex_models import retrofit_pair, set_step, tiny_tokenizer

from attnkit.evaluation import robustness as rb
from attnkit.evaluation import tasks as bundled

TINY = {"hidden": 64, "heads": 4, "kv_heads": 2, "layers": 2}


def _tiny_llama(seed: int = 0):
    source, _ = retrofit_pair("llama", "dex", seed=seed, **TINY)
    return source


def _retrofit(method: str, ramp_step: int):
    source, target = retrofit_pair("llama", method, **TINY)
    with torch.no_grad():  # non-zero new weights, so only the ramp keeps the retrofit exact
        for name, p in target.named_parameters():
            if name.split(".")[-2] in ("f_d", "diff_q_proj"):
                p.normal_(0, 0.3)
    set_step(target, ramp_step, 4)
    return source, target


def test_rtn_groups_levels_and_purity():
    torch.manual_seed(0)
    w = torch.randn(5, 100)  # 100 inputs: one full group of 64 and a padded one
    before = w.clone()
    q4 = rb.rtn(w, 4)
    assert torch.equal(w, before) and q4.shape == w.shape and q4.dtype == w.dtype
    for row in range(5):
        for lo, hi in ((0, 64), (64, 100)):
            group = w[row, lo:hi]
            scale = group.abs().max() / 7
            assert len(torch.unique(q4[row, lo:hi])) <= 16
            assert (q4[row, lo:hi] - group).abs().max() <= scale / 2 + 1e-6
            assert torch.allclose(q4[row, lo:hi].abs().max(), group.abs().max())  # the largest is kept
    err8, err4 = (rb.rtn(w, 8) - w).abs().mean(), (q4 - w).abs().mean()
    assert 0 < err8 < err4 / 8
    x = torch.randn(2, 3, 70)
    assert rb.rtn_rows(x).shape == x.shape and (rb.rtn_rows(x) - x).abs().max() < 0.05


def test_weight_and_kv_quantization_restore_the_model():
    model = _tiny_llama()
    ids = torch.randint(0, 300, (2, 24))
    rows = ids
    ref = model(input_ids=ids).logits
    with rb.quantized_weights(model, 4):
        assert not torch.allclose(model(input_ids=ids).logits, ref)
    with rb.int8_kv(model) as hooked:
        assert hooked == 2 * 2  # k_proj and v_proj of 2 layers
        kv = model(input_ids=ids).logits
        assert not torch.equal(kv, ref) and torch.allclose(kv, ref, atol=0.05)
    assert torch.equal(model(input_ids=ids).logits, ref)
    nll = rb.quantization(model, rows)
    assert set(nll) == {"fp", "w8", "w4", "kv8"} and all(len(v) == 2 for v in nll.values())
    assert abs(nll["w8"][0] - nll["fp"][0]) < abs(nll["w4"][0] - nll["fp"][0]) + 1e-3


def test_kurtosis_and_top_magnitude():
    torch.manual_seed(0)
    assert abs(rb.kurtosis(torch.randn(200_000)) - 3.0) < 0.1
    x = torch.zeros(1000)
    x[:5] = 100.0
    assert rb.kurtosis(x) > 100
    assert rb.top_magnitude(torch.arange(1, 101).float()) == 99.0  # 1 % of 100 values reach 99 or more


@pytest.mark.parametrize("method", ["plain", "dex", "diff"])
def test_outliers_per_layer_and_row_on_plain_and_retrofits(method):
    if method == "plain":
        model = _tiny_llama()
    else:
        _, model = _retrofit(method, 4)
    rows = torch.randint(0, 300, (3, 16))
    stats = rb.outliers(model, rows)
    for kind in ("attention", "hidden"):
        assert all(len(stats[kind][s]) == 2 and len(stats[kind][s][0]) == 3 for s in ("kurtosis", "top1pct", "max"))
        assert all(t <= m for t, m in zip(stats[kind]["top1pct"][0], stats[kind]["max"][0]))
    with torch.no_grad():
        hidden = model(input_ids=rows[:1], output_hidden_states=True).hidden_states[1]
    assert stats["hidden"]["max"][0][0] == pytest.approx(float(hidden.abs().max()))


def _item(tok) -> dict:
    context = 'x = 1\ngrove_17 = "p0c2me"\ny = 2\ngrove_42 = "k3v9x1"\nz = 3\n\nassert grove_42 == "'
    return {"context": context, "needle": ["grove_42", "k3v9x1"], "decoys": [["grove_17", "p0c2me"]]}


def test_value_positions_cover_the_value():
    tok = tiny_tokenizer()
    item = _item(tok)
    ids = tok(item["context"], add_special_tokens=False)["input_ids"]
    span = rb.value_positions(tok, item["context"], "k3v9x1")
    assert "k3v9x1" in tok.decode([ids[i] for i in span])


def test_attention_mass_is_the_source_at_ramp_zero_and_subtracts_the_second_map():
    tok = tiny_tokenizer()
    items = [_item(tok)]
    source, at_zero = _retrofit("diff", 0)
    plain = rb.attention_mass(source, tok, items)
    assert 0 < plain["needle"][0] < 1 and len(plain["needle_per_layer"]) == 2
    assert rb.attention_mass(at_zero, tok, items)["needle"] == pytest.approx(plain["needle"], abs=1e-6)
    _, ramped = _retrofit("diff", 4)
    ids = torch.tensor([tok(items[0]["context"], add_special_tokens=False)["input_ids"]])
    with rb.probed(ramped) as attns:
        for a in attns:
            a._attnkit_rows = []
        ramped(input_ids=ids)
        assert all(len(a._attnkit_rows) == 2 for a in attns)  # A1 and A2
        row = rb.effective_row(attns[0])
        assert torch.allclose(row.sum(-1), torch.ones(row.shape[0]), atol=1e-5)
        assert not torch.allclose(row, attns[0]._attnkit_rows[0][0])
    assert ramped.config._attn_implementation != rb.PROBE  # restored


def test_paired_statistics():
    a, b = [[1, 0, 1, 1, 0, 0]], [[1, 1, 1, 1, 0, 1]]
    result = rb.paired(a, b, resamples=500)
    assert result["difference"] == pytest.approx(2 / 6) and result["ci95"][0] <= 2 / 6 <= result["ci95"][1]
    assert result["mde80"] > 0 and result["seeds"] == 1
    same = rb.paired([[0.5, 1.0]] * 3, [[0.5, 1.0]] * 3, resamples=200)
    assert same["difference"] == 0 and same["ci95"] == [0, 0]
    assert rb.mcnemar_p([0] * 10, [1] * 10) == pytest.approx(2 / 2**10)
    assert rb.mcnemar_p([1, 0], [1, 0]) == 1.0


def test_distract_tasks_are_registered_and_their_items_are_well_formed():
    assert bundled.expand("attnkit-distract") == bundled.DISTRACT
    for name, (lo, hi) in zip(bundled.DISTRACT, ((32, 96), (128, 256), (320, 480))):
        docs = bundled.items(name)
        assert len(docs) == 200
        for doc in docs[:50]:
            values = [doc["needle"][1], *(v for _, v in doc["decoys"])]
            assert sorted(c[:-1] for c in doc["choices"]) == sorted(values)
            assert doc["choices"][doc["gold"]] == doc["needle"][1] + '"' and lo <= doc["distance"] <= hi
            assert len({n.split("_")[0] for n, _ in [doc["needle"], *doc["decoys"]]}) == 1  # one prefix
            assert all(doc["context"].count(f'"{v}"') == 1 for v in values)
            assert doc["context"].endswith(f'assert {doc["needle"][0]} == "')


@pytest.mark.slow
def test_task_correct_scores_each_item():
    model = _tiny_llama()
    tok = tiny_tokenizer()
    got = rb.task_correct(model, tok, ["attnkit-distract-near"], limit=3)
    assert list(got) == ["attnkit-distract-near"] and len(got["attnkit-distract-near"]) == 3
    assert set(got["attnkit-distract-near"]) <= {0, 1}
    json.dumps(got)
