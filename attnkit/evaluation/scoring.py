"""lm-eval's HFLM with loglikelihood requests scored once per shared context.

Why: a multiple-choice item is 4 requests that share one long context and differ in a few
continuation tokens. Stock HFLM runs the full context+continuation 4 times and computes logits
(and a log-softmax over the vocabulary) at every context position; on a CPU that is nearly all
of `attnkit eval`'s time. Here each distinct (truncated) context runs once, keeping only its
last position's logits, its KV cache is repeated for the continuations, and the continuations
run together as one batch on top of it. The figures are lm-eval's to float noise: the same
tokens, the same left truncation at `max_length`, the same log-softmax dtype, and the same
(log-likelihood, is-greedy) answers; only the order of floating-point operations differs.

A model whose forward cannot be used this way (no cache returned, a cache without
`batch_repeat_interleave`) falls back to HFLM's own path for the whole run.
"""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM

log = logging.getLogger(__name__)

Request = tuple[Any, list[int], list[int]]  # (cache key or None, context tokens, continuation tokens)

# logits (rows × width × vocab) of one continuation forward; more rows are split, each on its own cache copy
LOGITS_PER_CALL = 2**26


class SharedPrefixLM(HFLM):
    """HFLM whose `_loglikelihood_tokens` runs each distinct context once (see the module docstring).

    `progress(n)` is called with the number of tokens each forward pass processed, so a caller
    can draw one bar (with an ETA) over several models; lm-eval's own bar is not drawn.
    """

    def __init__(self, *args: Any, progress: Callable[[int], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._progress = progress or (lambda n: None)
        self._shared_ok: bool | None = None  # None: not tried yet
        params = inspect.signature(self.model.forward).parameters
        self._keep_kw = "logits_to_keep" in params
        # transformers 5.2x renamed `past_key_values` to `cache` (the old name warns); older 5.x know only the old one
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ------------------------------------------------------------------ lm-eval's entry point

    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False, override_bs: int | None = None
    ) -> list[tuple[float, bool]]:
        if self.backend != "causal" or self._shared_ok is False:
            return super()._loglikelihood_tokens(requests, disable_tqdm=True, override_bs=override_bs)
        groups = group_by_context(requests, self.max_length)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for prefix, members in groups:
            conts = [requests[i][2] for i in members]
            if len(members) == 1 or len(prefix) < max(len(c) for c in conts) - 1:
                # nothing to share, or a short shared context before long continuations (rolling perplexity
                # windows after the same one-token prefix): one plain causal pass per request is cheaper
                answers = [self._score_alone(prefix, c) for c in conts]
                for i, answer in zip(members, answers):
                    results[i] = answer
                    self._hook(requests[i][0], answer)
                continue
            try:
                answers = self._score_group(prefix, conts)
            except _Unsupported as why:
                if self._shared_ok:  # it worked before: a real error, not a missing feature
                    raise
                log.warning("scoring each context once is not possible for this model (%s); using lm-eval's path", why)
                self._shared_ok = False
                return super()._loglikelihood_tokens(requests, disable_tqdm=True, override_bs=override_bs)
            self._shared_ok = True
            for i, answer in zip(members, answers):
                results[i] = answer
                self._hook(requests[i][0], answer)
        return results  # type: ignore[return-value]

    def _hook(self, key: Any, answer: tuple[float, bool]) -> None:
        """lm-eval's cache hook, as HFLM calls it (rolling windows have no key; they are cached per document)."""
        if key is not None:
            self.cache_hook.add_partial("loglikelihood", key, answer)

    # ------------------------------------------------------------------ one context, its continuations

    def _forward(self, ids: torch.Tensor, cache: Any = None, keep: int = 0, use_cache: bool = False):
        """The model's output on `ids` (after `cache`); `keep` > 0: logits of the last `keep` positions only."""
        kwargs: dict[str, Any] = {"use_cache": use_cache or cache is not None}
        if cache is not None:
            kwargs[self._cache_kw] = cache
        if keep and self._keep_kw:
            kwargs["logits_to_keep"] = keep
        with torch.inference_mode():
            out = self.model(ids, **kwargs)
        if keep and not self._keep_kw:
            out.logits = out.logits[:, -keep:]
        return out

    def _log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)

    def _score_alone(self, prefix: list[int], cont: list[int]) -> tuple[float, bool]:
        """One request in one causal pass, as HFLM does, but with logits for the scored positions only.

        No cache: with one, SDPA gets an explicit mask instead of is_causal, much slower on long inputs.
        """
        ids = prefix + cont[:-1]
        out = self._forward(torch.tensor([ids], device=self.device), keep=len(cont))
        self._progress(len(ids))
        return _answer(self._log_softmax(out.logits[0]), cont)

    def _score_group(self, prefix: list[int], conts: list[list[int]]) -> list[tuple[float, bool]]:
        """(sum of log p, all tokens greedy) of every continuation after `prefix`, the prefix run once."""
        out = self._forward(torch.tensor([prefix], device=self.device), keep=1, use_cache=True)
        self._progress(len(prefix))
        cache = getattr(out, "cache", None)
        if cache is None:
            cache = getattr(out, "past_key_values", None)
        if cache is None or not hasattr(cache, "batch_repeat_interleave"):
            raise _Unsupported(f"the forward pass returned no repeatable cache ({type(cache).__name__})")
        first = self._log_softmax(out.logits[0, -1])  # predicts every continuation's first token
        tails = [c[:-1] for c in conts]  # the tokens fed after the prefix
        rows: list[torch.Tensor | None] = [None] * len(conts)
        todo = [i for i, t in enumerate(tails) if t]
        width = max((len(tails[i]) for i in todo), default=0)
        step = max(1, LOGITS_PER_CALL // (max(width, 1) * out.logits.shape[-1]))
        for start in range(0, len(todo), step):
            chunk = todo[start : start + step]
            this = cache if len(todo) <= step else copy.deepcopy(cache)
            if len(chunk) > 1:
                this.batch_repeat_interleave(len(chunk))
            w = max(len(tails[i]) for i in chunk)
            # right padding: with a causal mask, pad tokens after a row's last real token change nothing before it
            ids = torch.tensor([tails[i] + [tails[i][-1]] * (w - len(tails[i])) for i in chunk], device=self.device)
            logp = self._log_softmax(self._forward(ids, this).logits)
            self._progress(len(chunk) * w)
            for row, i in enumerate(chunk):
                rows[i] = logp[row, : len(tails[i])]
        return [_answer(first[None] if row is None else torch.cat([first[None], row]), cont) for row, cont in zip(rows, conts)]


def _answer(logp: torch.Tensor, cont: list[int]) -> tuple[float, bool]:
    """lm-eval's answer from log-probs [len(cont), vocab]: (sum of log p(cont), every token the argmax)."""
    target = torch.tensor(cont, device=logp.device)
    greedy = bool((logp.argmax(dim=-1) == target).all())
    return float(logp.gather(1, target[:, None]).sum()), greedy


class _Unsupported(RuntimeError):
    """The model cannot be scored with a shared cache (the caller falls back to lm-eval's path)."""


def group_by_context(requests: list[Request], max_length: int) -> list[tuple[list[int], list[int]]]:
    """[(truncated context tokens, request indices)], longest context first (errors and ETA early).

    The context is what lm-eval feeds before the continuation: (context + continuation) keeps its
    last max_length + 1 tokens, so a long context loses tokens from the left.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (_, ctx, cont) in enumerate(requests):
        if not ctx or not cont or len(cont) > max_length:
            raise ValueError(f"lm-eval request {i}: empty context/continuation or continuation > max_length")
        keep = max_length + 1 - len(cont)
        prefix = tuple(ctx[-keep:])
        groups.setdefault(prefix, []).append(i)
    return sorted(((list(p), m) for p, m in groups.items()), key=lambda g: -len(g[0]))

