"""Quality measured during healing: held-out validation loss (always) and `attnkit eval` tasks (optional)."""

from __future__ import annotations

import importlib
import math

import torch

from attnkit.training.losses import next_token_ce


@torch.no_grad()
def validation_loss(model: torch.nn.Module, rows: torch.Tensor, batch_size: int, device, rank: int = 0, world: int = 1):
    """Mean next-token CE over `rows` [n, L]; each process takes rows[rank::world] and sums are reduced.

    Returns (loss, count) summed locally; the caller reduces across processes.
    """
    was_training = model.training
    model.eval()
    mine = rows[rank::world]
    total, count = 0.0, 0
    for start in range(0, len(mine), batch_size):
        batch = mine[start : start + batch_size].to(device)
        logits = model(input_ids=batch).logits
        n = batch.shape[0] * (batch.shape[1] - 1)
        total += float(next_token_ce(logits, batch)) * n
        count += n
    model.train(was_training)
    return total, count


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
