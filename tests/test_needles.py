"""Training needles (`attnkit.needles`, `data.needles` of a recipe)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.errors import AttnkitError
from attnkit.evaluation.tasks.build import _NAMES, DATA
from attnkit.needles import TRAIN_NAMES, NeedlePlanter
from attnkit.training.batches import load_train_rows
from attnkit.training.finetune import load_finetune_recipe
from test_finetune_fixtures import tiny, write_recipe  # noqa: F401

NEEDLE = re.compile(r'^(\w+_\d+) = "(\w{6})"$')
QUESTION = re.compile(r'^assert (\w+_\d+) == "(\w{6})"$', re.M)


def words(lines: list[str]) -> list[int]:  # a stand-in tokenizer: one token per word, one for the newline
    return [len(line.split()) + 1 for line in lines]


def document(n_lines: int) -> str:
    return "".join(f"x{i} = compute(a, b, {i})\n" for i in range(n_lines))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(1, 20), st.integers(0, 30), st.integers(5, 60), st.integers(0, 40),
       st.integers(0, 10**6))
def test_every_question_follows_its_needle_at_a_drawn_distance(n_lines, lo_s, span_s, lo_d, span_d, seed):
    planter = NeedlePlanter(words, (lo_s, lo_s + span_s), (lo_d, lo_d + span_d), seed=seed)
    text = document(n_lines)
    out = planter(text).splitlines()
    original = [line for line in out if not NEEDLE.match(line) and not QUESTION.match(line)]
    assert original == text.splitlines()  # the document itself is untouched, in order
    sizes = words(out)
    start = [sum(sizes[:i]) for i in range(len(out))]  # each line's first token
    planted, run = {}, 0  # run: questions just before this line at the same boundary
    for i, line in enumerate(out):
        if m := NEEDLE.match(line):
            assert m[1] not in planted and m[1].split("_")[0] in TRAIN_NAMES
            planted[m[1]] = (m[2], start[i] + sizes[i])
        elif m := QUESTION.match(line):
            value, end = planted.pop(m[1])
            assert m[2] == value
            # asked at the first line boundary once its drawn distance has passed since the needle's end:
            # late by at most a needle line and a document line (4 + 6 tokens) and the questions before it
            assert lo_d <= start[i] - end <= lo_d + span_d + 10 + 5 * run
        run = run + 1 if QUESTION.match(line) else 0


def test_planter_is_seeded_and_never_uses_the_evaluation_names():
    text = document(400)
    a = NeedlePlanter(words, (20, 40), (50, 90), seed=3)(text)
    assert a == NeedlePlanter(words, (20, 40), (50, 90), seed=3)(text)
    assert a != NeedlePlanter(words, (20, 40), (50, 90), seed=4)(text)
    assert not set(TRAIN_NAMES) & set(_NAMES)
    asked = QUESTION.findall(a)
    assert len(asked) >= 10
    far = [json.loads(line) for line in (DATA / "recall-far.jsonl").read_text().splitlines()]
    eval_values = {item["choices"][item["gold"]][:-1] for item in far}
    assert not eval_values & {v for _, v in asked}


def test_training_rows_carry_needles_and_the_recipe_checks_them(tiny, tmp_path):
    from attnkit.training.recipe import DataSection, NeedleSection

    plain = DataSection(source=str(tiny["corpus"]), seq_len=64)
    planted = DataSection(source=str(tiny["corpus"]), seq_len=64, needles=NeedleSection(spacing=[1, 3], distance=[3, 6]))
    rows_plain = load_train_rows(tiny["tokenizer"], plain, 8)
    rows_planted = load_train_rows(tiny["tokenizer"], planted, 8)
    assert rows_plain.shape == rows_planted.shape == (8, 64)
    text = tiny["tokenizer"].decode(rows_planted.flatten())
    assert "assert " in text and "assert " not in tiny["tokenizer"].decode(rows_plain.flatten())

    path = write_recipe(tmp_path / "r.yaml", model="m", output_dir="o", teacher="t", train={"patterns": ["q"]})
    assert load_finetune_recipe(path, ["data.needles.spacing=[60,120]"]).data.needles.distance == [140, 400]
    for bad in ("data.needles.spacing=[0,5]", "data.needles.spacing=[9,5]", "data.needles.distance=[7]"):
        extra = [] if "spacing" in bad else ["data.needles.spacing=[5,9]"]
        with pytest.raises(AttnkitError, match=r"recipe key data\.needles\.(spacing|distance): must be two"):
            load_finetune_recipe(path, [bad, *extra])


def test_recall_paired_statistics():
    from conftest import load_benchmark

    rp = load_benchmark("recall_paired.py", "bench_recall_paired")
    d = rp.paired([True, True, False, False], [True, False, True, True], resamples=2000)
    assert d["difference"] == 0.25 and (d["only_a"], d["only_b"]) == (1, 2) and d["mcnemar_p"] == 1.0
    assert d["ci95"][0] <= 0.25 <= d["ci95"][1]
    d = rp.paired([False] * 20, [True] * 10 + [False] * 10, resamples=2000)
    assert d["mcnemar_p"] == pytest.approx(2 / 2**10) and d["ci95"][0] > 0
    lo, hi = rp.wilson(89, 300)
    assert (round(lo, 3), round(hi, 3)) == (0.248, 0.351)


def test_more_pending_needles_than_names_does_not_hang():
    planter = NeedlePlanter(words, (1, 1), (10**9, 10**9), seed=0)  # a needle every line, never asked
    out = planter(document(2500)).splitlines()
    names = [m[1] for line in out if (m := NEEDLE.match(line))]
    assert len(names) == len(set(names)) == len(TRAIN_NAMES) * 90


class _CharTokenizer:  # one token per character, ids below the tiny models' vocabulary of 300
    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) % 300 for c in text]}


@pytest.mark.parametrize("slots", [0, 3])
def test_recall_scores_with_a_shared_cache_equal_one_forward_per_choice(slots):
    """`choice_scores` reads the context once (in chunks, with a cache) and each choice from a copy of it:
    the same log-likelihoods as one full forward over context + choice, for the source and for Titans
    with and without slots (whose cache cannot be cropped, only copied)."""
    import torch
    from conftest import load_benchmark
    from test_titans import open_memory, titans_model

    rp = load_benchmark("recall_paired.py", "bench_recall_paired")
    source, target = titans_model("llama", window=6, chunk=2, slots=slots)
    open_memory(target)
    tok = _CharTokenizer()
    context, choices = 'k = "abcdef"\n' + "x = f(y)\n" * 3 + 'assert k == "', ["abcdef", "zyxwvu", "a"]
    for model in (source, target):
        want = []
        for choice in choices:
            ids = torch.tensor([tok(context + choice)["input_ids"]])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1], dim=-1)
            n = len(context)
            want.append(logp[n - 1:].gather(-1, ids[0, n:, None]).sum().item())
        got = rp.choice_scores(model, tok, context, choices, chunk=7)
        assert got == pytest.approx(want, abs=1e-4)
