"""The calibration text a conversion reads: calibration rows, held-out rows and `--kv-budget`'s spare rows."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from attnkit.converters.common import calibration_text
from attnkit.data import pack_tokens
from attnkit.io.resolve import resolve_model

T = 64  # tokens per row


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("reference"))


def test_spare_rows_are_the_validation_rows_after_the_held_out_ones(tokenizer):
    text = calibration_text(tokenizer, "python", T, 4 * T, 3 * T, seed=0, n_spare=2 * T)
    validation = pack_tokens(tokenizer, "python", "validation", T, 5 * T, seed=0)
    assert torch.equal(text.held_out, pack_tokens(tokenizer, "python", "validation", T, 3 * T, seed=0))
    assert torch.equal(text.spare, validation[3:]) and text.spare.shape == (2, T)
    assert torch.equal(text.calib, pack_tokens(tokenizer, "python", "train", T, 7 * T, seed=0)[:4])
    assert text.note == "validation split"


def test_held_out_rows_do_not_depend_on_the_spare_rows_asked(tokenizer):
    plain = calibration_text(tokenizer, "python", T, 2 * T, 2 * T + 5, seed=1)  # a part row of held-out tokens is dropped
    spare = calibration_text(tokenizer, "python", T, 2 * T, 2 * T + 5, seed=1, n_spare=3 * T)
    assert plain.spare.shape[0] == 0 and spare.spare.shape[0] == 3
    assert torch.equal(plain.held_out, spare.held_out) and plain.held_out.shape == (2, T)


def test_fewer_held_out_tokens_than_a_row_take_the_last_calibration_rows(tokenizer):
    text = calibration_text(tokenizer, "python", T, 4 * T, T // 2, seed=0, n_spare=2 * T)
    assert "last rows of the calibration text" in text.note
    assert text.held_out.shape == (1, T) and text.spare.shape[0] == 0
    assert not any(torch.equal(text.held_out[0], row) for row in text.calib)
