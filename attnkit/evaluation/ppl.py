"""The perplexities attnkit shows, each under one name with one sentence saying which text and which
windows, in the same words wherever it appears (convert / eval / finetune output, the model card,
README.md). They are measured on different text in different windows, so their values differ for the
same model (the bundled reference: held-out ppl 35.71, attnkit-ppl-quick 25.53, validation ppl 31.03)
and only figures under the same name compare.

- **held-out ppl** (`attnkit convert`): rows of the calibration text (`--calib`, default the Python
  standard library) from its validation split, never calibrated on, each row scored from its first
  token. MLA: `--eval-tokens` / `--calib-seq-len` rows (default 8 × 512); the other methods 4 rows.
- **attnkit-ppl** (`attnkit eval`, lm-eval): `token_perplexity` of the bundled `attnkit-ppl` task, per
  token over 24 held-out Python files (`attnkit-ppl-quick`: the first 8), each file scored whole in
  rolling 1024-token windows. lm-eval's `word_perplexity` (per whitespace word) is kept in the JSON but
  not shown.
- **validation ppl** (`attnkit finetune`, `attnkit pretrain`): the recipe's validation rows
  (`data.val_tokens` in `data.seq_len`-token rows of the data's validation split); the bundled models'
  own figure is their whole validation split in 256-token windows.
"""

from __future__ import annotations

HELD_OUT = "held-out ppl"
TASK = "attnkit-ppl"
VALIDATION = "validation ppl"
WINDOW = 1024  # attnkit eval's rolling window (evaluation.score.DEFAULT_MAX_LENGTH)
PPL_FILES = 24  # documents of the attnkit-ppl task (tasks/data/ppl.jsonl); attnkit-ppl-quick: the first 8

# metrics of the attnkit-ppl tasks that eval prints and the card shows, in this order: the figure first
MAIN_METRICS = ["token_perplexity", "byte_perplexity", "bits_per_byte"]


def held_out(calibration: dict | None) -> str:
    """'held-out ppl (8 × 512-token rows of --calib python's validation split)' from a conversion
    report's `calibration` block (fields it lacks are left out)."""
    c = calibration or {}
    rows, seq_len = c.get("held_out_rows"), c.get("seq_len")
    where = str(c.get("held_out_from") or "validation split")
    size = f"{rows} × {seq_len}-token rows" if rows and seq_len else (f"{seq_len}-token rows" if seq_len else "rows")
    if not where.endswith("split"):  # a source without validation documents: its last rows
        return f"{HELD_OUT} ({size}: {where})"
    calib = f"--calib {c['source']}'s" if c.get("source") else "the calibration text's"
    return f"{HELD_OUT} ({size} of {calib} {where})"


TASK_SENTENCE = (f"token_perplexity ({TASK}): per token over {PPL_FILES} held-out Python files ({TASK}-quick: "
                 f"the first 8), in rolling {WINDOW}-token windows.")


def task_sentence(tasks) -> str | None:
    """The line under a table that shows an attnkit-ppl task's token_perplexity (None without one)."""
    return TASK_SENTENCE if any(str(t).startswith(TASK) for t in tasks) else None


def validation_text(rows: int | None = None, seq_len: int | None = None) -> str:
    """'16 × 1024-token rows of the data's validation split': what a fine-tune's validation ppl is measured on."""
    size = f"{rows} × {seq_len}-token rows" if rows and seq_len else "rows"
    return f"{size} of the data's validation split"


def shown_metrics(task: str, metrics: dict) -> list[str]:
    """The metrics of `task` that eval prints and the card shows, in that order."""
    if str(task).startswith(TASK):
        keep = MAIN_METRICS
    else:
        keep = ["acc", "acc_norm"] if str(task).startswith("attnkit-") else list(metrics)
    return [m for m in keep if m in metrics and not str(m).endswith("_stderr")]
