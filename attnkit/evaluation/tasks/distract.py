"""Build the distractor recall tasks' data: one needle among k look-alike decoys, at three distances.

    python -m attnkit.evaluation.tasks.distract --tokenizer attnkit/assets/reference

The Differential Transformer paper's first claim is better retrieval of key information *among
distractors*. The plain recall tasks (build.py) offer three values that never occur in the context,
so a model can answer by "which of these did I see?". Here every choice is in the context: the needle
`grove_42 = "k3v9x1"` and k decoys with the same name prefix and the same value pattern
(`grove_17 = "p0c2me"`, ...), placed on random lines before and after the needle. The question asks for
the needle's name; the choices are its value and the k decoy values (chance 1/(k+1)).

Three tasks, by the distance (in tokens of the reference tokenizer) from the needle's end to the answer:
near 32-96, mid 128-256, far 320-480. Each item records `distance`, `needle` [name, value] and
`decoys` [[name, value], ...] so a measure can find the spans (attention mass on the needle, in
`attnkit.evaluation.robustness`). The data is committed like the other tasks' (held-out code, the
validation split of `python`, its own seed).
"""

from __future__ import annotations

import argparse
import json
import random
from itertools import accumulate, islice, takewhile
from pathlib import Path

from attnkit.data import Document, iter_documents, shuffled
from attnkit.evaluation.tasks.build import DATA, write_jsonl
from attnkit.needles import needle_line, question, random_value

DISTANCES = {"near": (32, 96), "mid": (128, 256), "far": (320, 480)}
DECOYS = 3
_PREFIXES = ["atlas", "beacon", "cobalt", "drift", "ember", "falcon", "gamma", "hollow", "indigo", "jasper"]


def names(rng: random.Random, k: int) -> list[str]:
    """k + 1 distinct names with one shared prefix: the needle's first, then the decoys'."""
    prefix = rng.choice(_PREFIXES)
    return [f"{prefix}_{n}" for n in rng.sample(range(10, 100), k + 1)]


def plant(lines: list[str], pairs: list[tuple[str, str]], needle_at: int, rng: random.Random) -> list[str]:
    """`lines` with the needle (pairs[0]) before line `needle_at` and each decoy before a random line."""
    slots = [(needle_at, 0)] + [(rng.randrange(0, len(lines) + 1), i) for i in range(1, len(pairs))]
    out = list(lines)
    for at, i in sorted(slots, key=lambda s: (-s[0], -s[1])):  # from the end, so earlier slots stay valid
        out.insert(at, needle_line(*pairs[i]))
    return out


def item(item_id: str, lines: list[str], rng: random.Random, k: int, count) -> dict:
    """One multiple-choice item: the code with needle + decoys, then the question for the needle."""
    pairs = [(n, random_value(rng)) for n in names(rng, k)]
    body = plant(lines, pairs, rng.randrange(2, 5), rng)
    context = "\n".join(body) + "\n\n" + question(pairs[0][0])
    needle_end = context.index("\n", context.index(needle_line(*pairs[0]))) + 1
    order = rng.sample(range(k + 1), k + 1)
    choices = [f'{pairs[i][1]}"' for i in order]
    return {"id": item_id, "context": context, "choices": choices, "gold": order.index(0),
            "distance": count(context[needle_end:]) + 1, "needle": list(pairs[0]), "decoys": [list(p) for p in pairs[1:]]}


def items(docs: list[Document], tokenizer, distance: tuple[int, int], n: int, rng: random.Random,
          k: int = DECOYS, per_doc: int = 4) -> list[dict]:
    """Up to `n` items whose needle ends `distance` tokens (inclusive) before the answer's first token;
    at most `per_doc` per file, on disjoint lines."""
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    reserve = 12 + (k + 1) * count(needle_line("atlas_10", "abcdef") + "\n") // 2  # the question, the decoys
    out: list[dict] = []
    for d in docs:
        made = (c for c in _candidates(d, count, distance, reserve, rng, k) if distance[0] <= c["distance"] <= distance[1])
        out.extend(islice(made, min(per_doc, n - len(out))))
        if len(out) >= n:
            break
    return out


def _candidates(d: Document, count, distance: tuple[int, int], reserve: int, rng: random.Random, k: int):
    """Items from consecutive stretches of one file: 4 lines, then lines up to a drawn distance."""
    lines = d.text.splitlines()
    sizes = [count(line + "\n") for line in lines]
    start = 0
    while start + 6 < len(lines):
        budget = rng.randint(*distance) - reserve
        end = start + 4 + sum(1 for _ in takewhile(budget.__ge__, accumulate(sizes[start + 4:])))
        yield item(f"{d.id}:{start}@{distance[0]}-{distance[1]}", lines[start:end], rng, k, count)
        start = max(end, start + 6)


def build(tokenizer, seed: int = 4321, n: int = 200, k: int = DECOYS) -> dict:
    docs = shuffled(list(iter_documents("python", "validation")), seed)
    counts = {}
    for i, (label, distance) in enumerate(DISTANCES.items()):
        rows = items(docs, tokenizer, distance, n, random.Random(seed + i), k)
        write_jsonl(DATA / f"distract-{label}.jsonl", rows)
        counts[f"attnkit-distract-{label}"] = len(rows)
    return counts


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default=str(Path(__file__).resolve().parents[2] / "assets" / "reference"))
    parser.add_argument("--seed", type=int, default=4321)
    parser.add_argument("-n", type=int, default=200, help="items per distance")
    args = parser.parse_args()
    print(json.dumps(build(AutoTokenizer.from_pretrained(args.tokenizer), args.seed, args.n), indent=2))


if __name__ == "__main__":
    main()
