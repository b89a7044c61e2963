"""Build the offline lm-eval tasks' data from held-out code (the validation split of `python`).

    python -m attnkit.evaluation.tasks.build --tokenizer attnkit/assets/reference

The output (JSONL beside this file) is committed, so evaluation never depends on which Python the
user has. Three tasks:
* attnkit-ppl       loglikelihood_rolling over whole held-out files (perplexity)
* attnkit-complete  multiple choice: the true next line among 3 distractor lines of the same file
* attnkit-recall-N  needle retrieval: one `name = "value"` line in the first quarter of N tokens of
                    code, then `assert name == "` — which of 4 values completes it (3 never seen)
* attnkit-recall-far the same question with the needle 160-250 tokens before it: beyond a 64- or
                    128-token attention window, within what the reference (1024-token training) uses;
                    up to 4 items per file, so it has hundreds of items (a window-vs-memory difference
                    of a few points is then visible)
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from attnkit.data import Document, iter_documents, shuffled
from attnkit.needles import needle_line, question, random_value

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
RECALL_LENGTHS = (256, 512, 1024)
FAR_DISTANCE = (160, 250)  # tokens from the needle's end to the question's end
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
        items.append(_needle_item(f"{d.id}@{length}", kept, (1, max(2, len(kept) // 4)), rng))
        if len(items) >= n:
            break
    return items


def _needle_item(item_id: str, lines: list[str], place: tuple[int, int], rng: random.Random) -> dict:
    """`lines` with a `name = "value"` line inserted before a line drawn from range(*place), asked
    for at the end; four choices (three values never in the context), shuffled."""
    name = f"{rng.choice(_NAMES)}_{rng.randint(10, 99)}"
    values = [random_value(rng) for _ in range(4)]
    at = rng.randrange(*place)
    lines = [*lines[:at], needle_line(name, values[0]), *lines[at:]]
    choices = [f'{v}"' for v in values]
    order = rng.sample(range(4), 4)
    return {"id": item_id, "context": "\n".join(lines) + "\n\n" + question(name),
            "choices": [choices[i] for i in order], "gold": order.index(0)}


def recall_far_items(docs: list[Document], tokenizer, n: int, rng: random.Random, per_doc: int = 6,
                     distance: tuple[int, int] = FAR_DISTANCE) -> list[dict]:
    """Needle items whose needle ends `distance` tokens (inclusive range, the question and the
    answer's first token counted) before the answer: 2-4 lines of code, the needle, code up to a drawn
    distance, the question. Items of a file use disjoint lines; each records its `distance`."""
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    items = []
    for d in docs:
        lines = d.text.splitlines()
        sizes = [count(line + "\n") for line in lines]
        start, made = 0, 0
        while made < per_doc and start + 5 < len(lines):
            want, end, tokens = rng.randint(*distance), start + 4, 0
            while end < len(lines) and tokens + sizes[end] <= want - 12:  # room for the question
                tokens += sizes[end]
                end += 1
            item = _needle_item(f"{d.id}:{start}@far", lines[start:end], (2, 5), rng)
            needle_end = item["context"].index("\n", item["context"].index(' = "')) + 1
            item["distance"] = count(item["context"][needle_end:]) + 1
            if distance[0] <= item["distance"] <= distance[1]:
                items.append(item)
                made += 1
                if len(items) >= n:
                    return items
            start = max(end, start + 5)
    return items


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def build(tokenizer, seed: int = 1234, n_ppl: int = 24, n_complete: int = 240, n_recall: int = 40,
          n_far: int = 300) -> dict:
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
    far = recall_far_items(docs, tokenizer, n_far, random.Random(seed + 1))  # its own draws: the files above unchanged
    write_jsonl(DATA / "recall-far.jsonl", far)
    counts["attnkit-recall-far"] = len(far)
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
