"""Text sources: deterministic split, no document in both splits, file/JSONL sources, packing."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.data import Document, iter_documents, pack_tokens, shuffled, split_of
from attnkit.errors import AttnkitError


@given(st.text(min_size=1, max_size=80))
@settings(max_examples=50, deadline=None)
def test_split_is_a_pure_function_of_the_id(doc_id):
    assert split_of(doc_id) == split_of(doc_id) in ("train", "validation")


def test_python_corpus_splits_are_disjoint_and_stable():
    train = [d.id for d in iter_documents("python", "train")]
    val = [d.id for d in iter_documents("python", "validation")]
    assert train and val
    assert not set(train) & set(val)
    assert 0.02 < len(val) / (len(train) + len(val)) < 0.10
    assert val == [d.id for d in iter_documents("python", "validation")]
    assert all(d.startswith("stdlib/") and "site-packages" not in d for d in train[:200])


def test_folder_and_jsonl_sources(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    ids = sorted(d.id for d in iter_documents(str(tmp_path), "all"))
    assert ids == ["a.txt", "b.jsonl#0", "b.jsonl#2"]
    single = list(iter_documents(str(tmp_path / "a.txt"), "all"))
    assert single == [Document("a.txt", "hello world\n")]


@pytest.mark.parametrize(
    "content, message",
    [("not json\n", "not valid JSON"), (json.dumps({"body": "x"}) + "\n", "no string field 'text'")],
)
def test_bad_jsonl_is_refused_with_the_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(AttnkitError, match=message):
        list(iter_documents(str(path), "all"))


def test_unknown_source_and_split():
    with pytest.raises(AttnkitError, match="not python"):
        list(iter_documents("/no/such/corpus", "train"))
    with pytest.raises(AttnkitError, match="unknown split"):
        list(iter_documents("python", "test"))


def test_shuffle_ignores_input_order():
    docs = [Document(str(i), "x") for i in range(20)]
    assert shuffled(docs, 3) == shuffled(list(reversed(docs)), 3)
    assert shuffled(docs, 3) != shuffled(docs, 4)


class _CharTokenizer:
    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) % 50 + 1 for c in t] for t in texts]}


def test_pack_tokens_rows_and_too_small_source(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefghij" * 10)
    rows = pack_tokens(_CharTokenizer(), str(tmp_path), "all", seq_len=16, n_tokens=64)
    assert rows.shape == (4, 16)
    with pytest.raises(AttnkitError, match="fewer than one sequence"):
        pack_tokens(_CharTokenizer(), str(tmp_path), "all", seq_len=4096)
