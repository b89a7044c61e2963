"""Where a healed model still loses: token perplexity per position bucket on the attnkit-ppl files.

    python -m attnkit.training.position_ppl reference out/healed [out/other ...] [--max-length 1024]

The windows are lm-eval's own (`get_rolling_token_windows` + `make_disjoint_window`, EOS prefix),
as `attnkit eval --tasks attnkit-ppl` scores them; each scored token is bucketed by its position in
the window, i.e. by how much context it had. Prints a table and, with --json, writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

BUCKETS = ((0, 64), (64, 256), (256, 512), (512, 1024))


def windows(token_ids: list[int], prefix: int, max_length: int) -> list[tuple[list[int], int]]:
    """[(context + target tokens, number of scored tokens at its end)] — lm-eval's rolling, disjoint windows."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    out = []
    for pair in get_rolling_token_windows(token_ids, prefix, max_length, context_len=1):
        context, target = make_disjoint_window(pair)
        out.append((context + target, len(target)))
    return out


@torch.no_grad()
def bucket_nll(model, token_ids: list[int], prefix: int, max_length: int, buckets=BUCKETS) -> torch.Tensor:
    """[len(buckets), 2] = (NLL sum, token count) per bucket of input position for one document."""
    acc = torch.zeros(len(buckets), 2, dtype=torch.float64)
    for tokens, n in windows(token_ids, prefix, max_length):
        x, target = torch.tensor([tokens[:-1]]), torch.tensor(tokens[1:])  # [1, T], [T]: position t predicts t+1
        nll = torch.nn.functional.cross_entropy(model(input_ids=x).logits[0].float(), target, reduction="none")
        pos = torch.arange(len(target))
        scored = pos >= len(target) - n  # [T] only the window's predicted tokens
        for b, (lo, hi) in enumerate(buckets):
            m = scored & (pos >= lo) & (pos < hi)
            acc[b, 0] += float(nll[m].sum())
            acc[b, 1] += int(m.sum())
    return acc


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnkit.evaluation.tasks.build import DATA
    from attnkit.io.resolve import resolve_model
    from attnkit.sdpa import fused_kwargs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="`reference`, folders or Hub ids (same tokenizer)")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    paths = [resolve_model(m) for m in args.models]
    tok = AutoTokenizer.from_pretrained(paths[0])
    docs = [json.loads(line)["text"] for line in (DATA / "ppl.jsonl").read_text().splitlines()]
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    result = {}
    for name, path in zip(args.models, paths):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **fused_kwargs(path)).eval()
        acc = sum(bucket_nll(model, d, tok.eos_token_id, args.max_length) for d in ids)
        result[name] = {f"{lo}-{hi}": {"ppl": round(math.exp(s / n), 3), "tokens": int(n)} for (lo, hi), (s, n) in zip(BUCKETS, acc.tolist())}
        result[name]["all"] = {"ppl": round(math.exp(float(acc[:, 0].sum() / acc[:, 1].sum())), 3), "tokens": int(acc[:, 1].sum())}
    cols = [f"{lo}-{hi}" for lo, hi in BUCKETS] + ["all"]
    print("model | " + " | ".join(f"pos {c}" for c in cols))
    print("tokens | " + " | ".join(str(result[args.models[0]][c]["tokens"]) for c in cols))
    for name in args.models:
        print(f"{name} | " + " | ".join(f"{result[name][c]['ppl']:.2f}" for c in cols))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
