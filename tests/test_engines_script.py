"""Pure helpers of benchmarks/engines/llama_cpp.py (no build, no llama.cpp, no model)."""
import math

import pytest
from conftest import load_benchmark



@pytest.fixture(scope="module")
def lc():
    return load_benchmark("engines/llama_cpp.py", "bench_llama_cpp")


def test_windows_follow_llama_perplexity(lc):
    # fewer than 2*n_ctx tokens: llama-perplexity refuses
    assert lc.perplexity_windows(1023, 512) == []
    # whole chunks only, from the start
    assert lc.perplexity_windows(1600, 512) == [(0, 512), (512, 1024), (1024, 1536)]
    # logits at n/2 .. n-2 score targets n/2+1 .. n-1: 255 per 512-window
    lo, hi = lc.scored_positions(512)
    assert (lo, hi) == (256, 511) and hi - lo == 255


def test_window_tokens_replaces_first_with_bos(lc):
    toks = list(range(10, 20))
    assert lc.window_tokens(toks, 2, 6, bos=None) == [12, 13, 14, 15]
    assert lc.window_tokens(toks, 2, 6, bos=0) == [0, 13, 14, 15]
    assert toks[2] == 12  # the stream itself is untouched


def test_parse_outputs(lc):
    log = "perplexity: calculating perplexity over 3 chunks\n[1]12.3456,[2]11.0000,[3]10.5000,\n" \
          "Final estimate: PPL = 10.5000 +/- 0.12345\n"
    assert lc.parse_final_ppl(log) == pytest.approx(10.5)
    assert lc.parse_chunk_ppls(log) == [12.3456, 11.0, 10.5]
    assert lc.parse_final_ppl("nothing") is None
    assert math.isnan(lc.parse_chunk_ppls("[1]nan,[2]-nan,")[1])


def test_first_error_line_prefers_the_assert(lc):
    log = ("llama_model_loader: loaded meta data\n"
           "/src/llama-model.cpp:1365: GGML_ASSERT(hparams.n_expert_groups < hparams.n_expert) failed\n"
           "error: something later\n")
    assert lc.first_error_line(log) == "GGML_ASSERT(hparams.n_expert_groups < hparams.n_expert) failed"
    log2 = "llama_model_load: error loading model: key not found in model: deepseek2.attention.q_lora_rank\n"
    assert "key not found in model: deepseek2.attention.q_lora_rank" in lc.first_error_line(log2)
    assert lc.first_error_line("") == "no output"


def test_python_error_line_is_one_line(lc):
    tb = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
          "    raise ValueError('bad')\nValueError: bad\n")
    assert lc.python_error_line(tb) == "ValueError: bad"


def test_byte_level_pre_tokenizer(lc):
    tok = {"model": {"type": "BPE"}, "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}}
    assert lc.byte_level_pre_tokenizer(tok) == "gpt-2"
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split"}, {"type": "ByteLevel", "use_regex": False}]}
    assert lc.byte_level_pre_tokenizer(tok) is None
    assert lc.byte_level_pre_tokenizer({"model": {"type": "Unigram"}}) is None


def test_ratio(lc):
    assert lc.ratio(2.0, 1.0) == 2.0
    assert lc.ratio(None, 1.0) is None
    assert lc.ratio(float("nan"), 1.0) is None


def test_half_split_to_pairs(lc):
    # (x0, x1, x2, y0, y1, y2) -> (x0, y0, x1, y1, x2, y2)
    perm = lc.half_split_to_pairs(6)
    assert perm == [0, 3, 1, 4, 2, 5]
    assert sorted(perm) == list(range(6))
