"""Quality measured during healing: held-out validation loss (always) and `attnkit eval` tasks (optional)."""

from __future__ import annotations

import importlib
import math

import torch

from attnkit.training import chunked_head
from attnkit.training.losses import next_token_ce


@torch.no_grad()
def validation_loss(model: torch.nn.Module, rows: torch.Tensor, batch_size: int, device, rank: int = 0, world: int = 1,
                    head: torch.nn.Module | None = None):
    """Mean next-token CE over `rows` [n, L]; each process takes rows[rank::world] and sums are reduced.
    With `head` (checked by `chunked_head.matches`), the CE runs over it in chunks: no whole logits.

    Returns (loss, count) summed locally; the caller reduces across processes.
    """
    was_training = model.training
    model.eval()
    mine = rows[rank::world]
    total, count = 0.0, 0
    for start in range(0, len(mine), batch_size):
        batch = mine[start : start + batch_size].to(device)
        n = batch.shape[0] * (batch.shape[1] - 1)
        total += float(_batch_ce(model, batch, head)) * n
        count += n
    model.train(was_training)
    return total, count


def _batch_ce(model: torch.nn.Module, batch: torch.Tensor, head: torch.nn.Module | None) -> torch.Tensor:
    if head is None:
        return next_token_ce(model(input_ids=batch).logits, batch)
    with chunked_head.final_hidden(head) as kept:
        model(input_ids=batch)
    return chunked_head.next_token_ce(kept.hidden, batch, head, chunked_head.softcap_of(model))


def reduce_loss(accelerator, total: float, count: int) -> dict[str, float]:
    """Sum (loss·tokens, tokens) over processes → {'loss', 'token_perplexity'}."""
    t = torch.tensor([total, float(count)], dtype=torch.float64, device=accelerator.device)
    t = accelerator.reduce(t, reduction="sum")
    loss = float(t[0] / t[1])
    return {"loss": round(loss, 5), "token_perplexity": round(math.exp(loss), 4)}


def eval_tasks(model, tokenizer, tasks: str | None, limit: int | None) -> tuple[dict | None, str | None]:
    """`attnkit.evaluation.score.evaluate_model` on the in-memory model; (result, note-if-skipped)."""
    if not tasks:
        return None, None
    try:
        evaluate_model = importlib.import_module("attnkit.evaluation.score").evaluate_model
    except (ModuleNotFoundError, AttributeError):
        return None, "eval tasks skipped: attnkit.evaluation.score.evaluate_model is not available in this version"
    was_training = model.training
    model.eval()
    try:
        return evaluate_model(model, tokenizer=tokenizer, tasks=tasks, limit=limit), None
    finally:
        model.train(was_training)
