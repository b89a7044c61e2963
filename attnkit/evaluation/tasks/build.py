"""Build the offline lm-eval tasks' data from held-out code (the validation split of `python`).

    python -m attnkit.evaluation.tasks.build --tokenizer attnkit/assets/reference

The output (JSONL beside this file) is committed, so evaluation never depends on which Python the
user has. Three tasks:
* attnkit-ppl       loglikelihood_rolling over whole held-out files (perplexity)
* attnkit-complete  multiple choice: the true next line among 3 distractor lines of the same file
* attnkit-recall-N  needle retrieval: one `name = "value"` line in the first quarter of N tokens of
                    code, then `assert name == "` — which of 4 values completes it (3 never seen)
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

from attnkit.data import Document, iter_documents, shuffled

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
RECALL_LENGTHS = (256, 512, 1024)
_NAMES = ["alpha", "bravo", "cache", "delta", "ember", "flint", "grove", "harbor", "ivory", "jolt", "kepler", "lumen"]


def ppl_docs(docs: list[Document], n: int, max_chars: int) -> list[dict]:
    out = []
    for d in docs[:n]:
        text = d.text[:max_chars]
        text = text[: text.rfind("\n") + 1] or text  # end on a line boundary
        out.append({"id": d.id, "text": text})
    return out


def _candidate_lines(lines: list[str]) -> list[int]:
    seen, idx = set(), []
    for i, line in enumerate(lines):
        s = line.strip()
        if len(s) >= 16 and not s.startswith("#") and s not in seen and i >= 4:
            idx.append(i)
        seen.add(s)
    return idx


def complete_items(docs: list[Document], n: int, rng: random.Random, per_doc: int = 6) -> list[dict]:
    items = []
    for d in docs:
        lines = d.text.splitlines()
        cands = _candidate_lines(lines)
        if len(cands) < 8:
            continue
        for i in rng.sample(cands, min(per_doc, len(cands) // 4)):
            gold = lines[i]
            pool = [lines[j] for j in cands if abs(j - i) > 2 and lines[j].strip() != gold.strip()]
            pool = sorted(set(pool))
            if len(pool) < 3:
                continue
            choices = rng.sample(pool, 3) + [gold]
            rng.shuffle(choices)
            context = "\n".join(lines[max(0, i - 12) : i]) + "\n"
            items.append({"id": f"{d.id}:{i}", "context": context, "choices": choices, "gold": choices.index(gold)})
            if len(items) >= n:
                return items
    return items


def _value(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(6))


def recall_items(docs: list[Document], tokenizer, length: int, n: int, rng: random.Random) -> list[dict]:
    """Code of about `length` tokens with one `name = "value"` line in its first quarter; query it.

    The three distractor values never occur in the context, so the task measures retrieval over
    distance (what a KV-cache compression can break), at a length the model was trained for.
    """
    items = []
    for d in docs:
        lines = d.text.splitlines()
        kept, count = [], 0
        for line in lines:
            k = len(tokenizer(line + "\n", add_special_tokens=False)["input_ids"])
            if count + k > length - 30:  # room for the needle and the query
                break
            kept.append(line)
            count += k
        if count < length * 0.6 or len(kept) < 12:
            continue
        name = f"{rng.choice(_NAMES)}_{rng.randint(10, 99)}"
        values = [_value(rng) for _ in range(4)]
        kept.insert(rng.randrange(1, max(2, len(kept) // 4)), f'{name} = "{values[0]}"')
        context = "\n".join(kept) + f'\n\nassert {name} == "'
        choices = [f'{v}"' for v in values]
        order = rng.sample(range(4), 4)
        items.append({"id": f"{d.id}@{length}", "context": context, "choices": [choices[i] for i in order],
                      "gold": order.index(0)})
        if len(items) >= n:
            break
    return items


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def build(tokenizer, seed: int = 1234, n_ppl: int = 24, n_complete: int = 240, n_recall: int = 40) -> dict:
    docs = shuffled(list(iter_documents("python", "validation")), seed)
    rng = random.Random(seed)
    DATA.mkdir(exist_ok=True)
    counts = {}
    write_jsonl(DATA / "ppl.jsonl", rows := ppl_docs(docs, n_ppl, max_chars=6000))
    counts["attnkit-ppl"] = len(rows)
    write_jsonl(DATA / "complete.jsonl", rows := complete_items(docs, n_complete, rng))
    counts["attnkit-complete"] = len(rows)
    for length in RECALL_LENGTHS:
        write_jsonl(DATA / f"recall-{length}.jsonl", rows := recall_items(docs, tokenizer, length, n_recall, rng))
        counts[f"attnkit-recall-{length}"] = len(rows)
    return counts


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default=str(HERE.parent.parent / "assets" / "reference"))
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    print(json.dumps(build(AutoTokenizer.from_pretrained(args.tokenizer), args.seed), indent=2))


if __name__ == "__main__":
    main()
