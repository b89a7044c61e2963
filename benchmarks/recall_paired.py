"""Two models on the same recall items, compared item by item (the interval on the *difference*).

    python benchmarks/recall_paired.py MODEL_A MODEL_B [--task recall-far] [--out paired.json]

`attnkit eval` gives each model's accuracy with its own interval; when two models answer the same 300
items those intervals overlap long before the difference is in doubt. This scores every item of the
bundled recall task (`attnkit/evaluation/tasks/data/<task>.jsonl`) with both models through lm-eval, as
`attnkit eval` does (`--scorer lm-eval`, the default: one forward per item; or `--scorer plain`, without
lm-eval: the choice with the highest summed log-likelihood of its tokens after the context, the context
read once with a cache and each choice from a copy of it; the continuation's tokens are those of context +
choice past the context's own), then reports
each accuracy (95 % Wilson), the paired difference B − A with a 95 % interval (percentile bootstrap over
items, 10,000 resamples, seeded) and McNemar's exact two-sided p on the discordant items.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
from pathlib import Path

import torch
from tqdm import tqdm

DATA = Path(__file__).resolve().parents[1] / "attnkit" / "evaluation" / "tasks" / "data"


def choice_scores(model, tokenizer, context: str, choices: list[str], chunk: int = 512) -> list[float]:
    """Summed log-probability of each choice's tokens after the context. The tokens every choice shares
    (the context's, but its last) are read once with a cache, `chunk` tokens at a time as a server
    prefills; each choice then goes on from a copy of that cache. The same numbers as one forward over
    context + choice (decoding equals the full forward for every attnkit model), read once, not per choice,
    and without the T x T mask of a long forward."""
    n_ctx = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    seqs = [tokenizer(context + c, add_special_tokens=False)["input_ids"] for c in choices]
    shared = n_ctx - 1  # re-fed per choice, so its logits (predicting the choice's first token) come with it
    while shared and any(s[:shared] != seqs[0][:shared] for s in seqs):
        shared -= 1  # a context + choice tokenised across the boundary: share less
    cache = None
    with torch.no_grad():
        for start in range(0, shared, chunk):
            ids = torch.tensor([seqs[0][start:min(start + chunk, shared)]])
            cache = model(input_ids=ids, cache=cache, use_cache=True).cache
        scores = []
        for seq in seqs:
            rest = torch.tensor([seq[shared:]])  # [1, T - shared]
            logits = model(input_ids=rest, cache=copy.deepcopy(cache), use_cache=True).logits[0, :-1]
            logp = torch.log_softmax(logits.float(), dim=-1)  # row j predicts token shared + j + 1
            target = torch.tensor(seq[n_ctx:])
            scores.append(logp[n_ctx - 1 - shared:].gather(-1, target[:, None]).sum().item())
    return scores


def correct(model_spec: str, items: list[dict]) -> list[bool]:
    from attnkit.evaluation.load import load_model

    model, tokenizer, _ = load_model(model_spec)  # eval mode, attnkit's classes registered
    out = []
    for item in tqdm(items, desc=Path(model_spec).name, unit="item"):
        s = choice_scores(model, tokenizer, item["context"], item["choices"])
        out.append(max(range(len(s)), key=s.__getitem__) == item["gold"])
    return out


def correct_lm_eval(model_spec: str, task: str) -> list[bool]:
    """Per item, in the data file's order, whether lm-eval's `acc` (the scoring `attnkit eval` reports,
    one forward per item through the shared-prefix model) picks the gold choice."""
    from attnkit.evaluation.load import load_model
    from attnkit.evaluation.robustness import task_correct

    model, tokenizer, _ = load_model(model_spec)
    return [bool(x) for x in task_correct(model, tokenizer, [f"attnkit-{task}"])[f"attnkit-{task}"]]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def paired(a: list[bool], b: list[bool], resamples: int = 10_000, seed: int = 0) -> dict:
    """Difference of accuracies b − a on the same items: bootstrap interval and McNemar's exact p."""
    n = len(a)
    diffs = [int(y) - int(x) for x, y in zip(a, b)]
    rng = random.Random(seed)
    boot = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    only_b, only_a = diffs.count(1), diffs.count(-1)
    m = only_a + only_b
    tail = sum(math.comb(m, i) for i in range(min(only_a, only_b) + 1)) / 2**m if m else 1.0
    return {"difference": sum(diffs) / n, "ci95": [boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]],
            "only_a": only_a, "only_b": only_b, "mcnemar_p": min(1.0, 2 * tail)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_a")
    ap.add_argument("model_b")
    ap.add_argument("--task", default="recall-far", help="a file under attnkit/evaluation/tasks/data, no suffix")
    ap.add_argument("--scorer", choices=["lm-eval", "plain"], default="lm-eval",
                    help="lm-eval: the task through lm-eval as `attnkit eval` scores it (one forward per item); "
                         "plain: the context once with a cache, then each choice, no lm-eval (recall_distance.py's scoring)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    items = [json.loads(line) for line in (DATA / f"{args.task}.jsonl").read_text().splitlines()]
    if args.scorer == "lm-eval":
        a, b = correct_lm_eval(args.model_a, args.task), correct_lm_eval(args.model_b, args.task)
    else:
        a, b = correct(args.model_a, items), correct(args.model_b, items)
    result = {"task": args.task, "n": len(items), "models": {}}
    for name, got in ((args.model_a, a), (args.model_b, b)):
        result["models"][name] = {"acc": sum(got) / len(got), "wilson95": list(wilson(sum(got), len(got)))}
    result["b_minus_a"] = paired(a, b)
    for name, r in result["models"].items():
        print(f"{name:48s} acc {r['acc']:.4f}  95 % [{r['wilson95'][0]:.3f}, {r['wilson95'][1]:.3f}]")
    d = result["b_minus_a"]
    print(f"B - A {d['difference']:+.4f}  95 % [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]  "
          f"(only A right {d['only_a']}, only B right {d['only_b']}, McNemar p {d['mcnemar_p']:.4f})")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
