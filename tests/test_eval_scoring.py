"""`SharedPrefixLM` gives lm-eval's own answers (to float noise), and `attnkit eval`'s progress bar."""

import io

import pytest
import torch
from lm_eval.models.huggingface import HFLM
from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from attnkit.evaluation import scoring
from attnkit.evaluation.present import Progress
from attnkit.evaluation.score import eval_threads
from attnkit.evaluation.scoring import SharedPrefixLM, group_by_context
from attnkit.io.resolve import REFERENCE_DIR

VOCAB = 97
MAX_LENGTH = 24


def _tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, intermediate_size=48, max_position_embeddings=256)
        model = LlamaForCausalLM(config)
    else:  # the format `attnkit convert --to mla` writes
        config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=6, first_k_dense_replace=2, n_routed_experts=2,
                                  max_position_embeddings=256)
        model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # weights large enough that log-probs differ clearly between tokens
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REFERENCE_DIR)


def _greedy(model, ctx: list[int], n: int) -> list[int]:
    """The model's own argmax continuation: lm-eval's is_greedy must be True for it."""
    ids = list(ctx)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(ctx):]


def _requests(model) -> list[tuple]:
    g = torch.Generator().manual_seed(1)

    def rand(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    ctx, alone, long = rand(7), rand(3), rand(40)
    return [
        (("a", "b"), ctx, rand(1)), (None, ctx, rand(3)), (None, ctx, rand(5)),  # one context, uneven continuations
        (None, ctx, _greedy(model, ctx, 3)),  # greedy: is_greedy True
        (None, alone, rand(20)),  # nothing shared
        (None, [3], rand(10)), (None, [3], rand(12)),  # rolling-perplexity windows: one token shared, not worth it
        (None, long, rand(2)), (None, long, rand(4)),  # truncated from the left, by a different amount each
        (None, [5], rand(MAX_LENGTH)),  # a continuation of max_length
    ]


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_shared_prefix_gives_lm_evals_answers(family, tokenizer):
    model = _tiny(family)
    requests = _requests(model)
    stock = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=3, max_length=MAX_LENGTH)
    seen = []
    shared = SharedPrefixLM(pretrained=model, tokenizer=tokenizer, batch_size=3, max_length=MAX_LENGTH,
                            progress=seen.append)
    want = stock._loglikelihood_tokens(requests, disable_tqdm=True)
    got = shared._loglikelihood_tokens(requests)
    assert shared._shared_ok is True
    assert len(got) == len(want)
    for (ll, greedy), (ll_ref, greedy_ref) in zip(got, want):
        assert ll == pytest.approx(ll_ref, rel=1e-5, abs=1e-4)
        assert greedy == greedy_ref
    assert got[3][1] is True  # the greedy continuation
    assert len({round(ll, 3) for ll, _ in got}) == len(got)  # the answers are not all alike
    assert sum(seen) > 0


def test_requests_are_grouped_by_their_truncated_context():
    requests = [(None, [1, 2, 3], [4]), (None, [1, 2, 3], [5, 6]), (None, [9, 1, 2, 3], [4, 4, 4]), (None, [7], [8])]
    groups = group_by_context(requests, max_length=4)
    # the third keeps max_length + 1 - 3 = 2 context tokens; the second keeps 3: different groups
    assert groups == [([1, 2, 3], [0, 1]), ([2, 3], [2]), ([7], [3])]


def test_a_model_without_a_usable_cache_falls_back_to_lm_evals_path(tokenizer, monkeypatch):
    model = _tiny("llama")
    requests = _requests(model)
    want = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=3, max_length=MAX_LENGTH)._loglikelihood_tokens(
        requests, disable_tqdm=True)

    def no_cache(self, prefix, conts):
        raise scoring._Unsupported("no cache")

    monkeypatch.setattr(SharedPrefixLM, "_score_group", no_cache)
    shared = SharedPrefixLM(pretrained=model, tokenizer=tokenizer, batch_size=3, max_length=MAX_LENGTH)
    assert shared._loglikelihood_tokens(requests) == want
    assert shared._shared_ok is False


def test_progress_names_each_model_and_plans_the_whole_run():
    stream = io.StringIO()
    progress = Progress(["out/ref-mla", "reference"], stream)
    progress.start(0)
    progress.plan(100)
    assert progress.bar.total == 200  # the baseline, not started yet, is assumed to cost the same
    progress.update(60)
    progress.update(60)  # more than planned (a task the estimate did not know): the total follows
    assert progress.bar.total == 240
    progress.finish()
    progress.start(1)
    progress.plan(90)
    assert progress.bar.total == 210
    progress.update(90)
    progress.finish()
    progress.close()
    text = stream.getvalue()
    assert "[1/2] out/ref-mla" in text and "[2/2] reference" in text and "<" in text  # elapsed<remaining


def test_eval_threads_respects_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert eval_threads(0.01) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    n = eval_threads(0.05)
    assert n is None or 1 <= n <= torch.get_num_threads()
