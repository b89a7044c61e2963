#!/usr/bin/env python
"""Decode speed and KV-cache size of Hugging Face checkpoints in stock llama.cpp (`llama-batched-bench`).

For each MODEL_DIR: the same llama.cpp as ``llama_cpp.py`` (the ``llama-cpp-python`` sdist's vendored
tree, built once under ``~/.cache/attnkit/llama.cpp/<version>/build``; this script adds the
``llama-batched-bench`` target), the checkpoint converted to GGUF with that tree's own converter
(``--type``, default f16), then::

    llama-batched-bench -m M.gguf -c B_max*(P_max+T) -npp P,... -ntg T -npl B,... -pps --output-format jsonl

``-pps``: each prompt is prefilled once and its cache copied to the B sequences (the cache is not unified,
so every sequence holds and reads its own copy): decode at batch B over P-token contexts without paying B
prefills. Reported per (P, B): decode tokens/s (``speed_tg``), prefill tokens/s, and the KV cache llama.cpp
allocates (its ``llama_kv_cache: size = ... MiB`` log line) per token, from which the largest batch that a
fixed cache budget (``--kv-budget-gib``) holds at each context follows.

Usage::

    python benchmarks/engines/llama_cpp_bench.py SRC_DIR MLA_DIR --contexts 2048,8192,16384 --batches 1,16 \\
        --out results.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH_TARGET = "llama-batched-bench"


def _load(name: str, file: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def parse_jsonl_rows(text: str) -> list[dict]:
    """The JSON result lines `llama-batched-bench --output-format jsonl` prints (one per P, T, B)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            rows.append(json.loads(line))
    return rows


def parse_kv_bytes(text: str) -> int | None:
    """Bytes of the KV cache llama.cpp allocated (`llama_kv_cache: ... size = N MiB`), summed over lines."""
    sizes = [float(m) for m in re.findall(r"llama_kv_cache[^\n]*?size\s*=\s*([0-9.]+)\s*MiB", text)]
    return int(sum(sizes) * 2**20) if sizes else None


def largest_batch(budget_bytes: int, bytes_per_token: float, context: int, new_tokens: int) -> int:
    """How many sequences of `context` + `new_tokens` tokens a cache of `budget_bytes` holds."""
    return int(budget_bytes // (bytes_per_token * (context + new_tokens)))


def run_bench(binary: Path, gguf: Path, contexts: list[int], batches: list[int], new_tokens: int,
              threads: int | None) -> dict:
    n_ctx = max(batches) * (max(contexts) + new_tokens)
    cmd = [str(binary), "-m", str(gguf), "-c", str(n_ctx), "-b", "2048", "-ub", "512",
           "-npp", ",".join(map(str, contexts)), "-ntg", str(new_tokens), "-npl", ",".join(map(str, batches)),
           "-pps", "--output-format", "jsonl", *(["-t", str(threads)] if threads else [])]
    lc = _load("bench_llama_cpp", "llama_cpp.py")
    r = lc._run(cmd)
    text = r.stdout + r.stderr
    out = {"command": " ".join(cmd), "n_ctx": n_ctx}
    if r.returncode != 0:
        out["error"] = lc.first_error_line(text)
        return out
    kv = parse_kv_bytes(text)
    out.update({"kv_cache_bytes": kv, "kv_bytes_per_token": kv / n_ctx if kv else None,
                "rows": [{k: row[k] for k in ("pp", "tg", "pl", "speed_pp", "speed_tg", "t_pp", "t_tg")}
                         for row in parse_jsonl_rows(text)]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path, help="Hugging Face checkpoint folders")
    ap.add_argument("--type", default="f16", help="GGUF type (f32, f16, bf16, q8_0)")
    ap.add_argument("--contexts", default="2048,8192,16384")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-budget-gib", type=float, default=1.0, help="cache budget for the 'largest batch' column")
    ap.add_argument("--cache", type=Path, default=None, help="llama.cpp cache folder (as llama_cpp.py)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    lc = _load("bench_llama_cpp", "llama_cpp.py")
    cache = args.cache or lc.DEFAULT_CACHE
    version, tree = lc.get_tree(cache, lc.get_sdist(cache, None))
    build = cache / version / "build"
    lc.build(tree, build, args.jobs)  # configures and builds the harness's own targets once
    binary = build / "bin" / BENCH_TARGET
    if not binary.exists():
        r = lc._run(["cmake", "--build", str(build), "--target", BENCH_TARGET, "-j", str(args.jobs)])
        if r.returncode != 0:
            raise SystemExit(f"building {BENCH_TARGET} failed: {lc.first_error_line(r.stdout + r.stderr)}")
    lc.ensure_converter_deps(True)
    contexts = [int(v) for v in args.contexts.split(",")]
    batches = [int(v) for v in args.batches.split(",")]
    results = []
    for model in args.models:
        res: dict = {"model": model.name}
        with tempfile.TemporaryDirectory(prefix="attnkit-llama-bench-") as td:
            gguf = Path(td) / f"{model.name}-{args.type}.gguf"
            pre = lc.byte_level_pre_tokenizer(json.loads((model / "tokenizer.json").read_text()))
            conv = lc.convert(tree, model.resolve(), args.type, gguf, pre)
            if "error" in conv:
                res["error"] = conv["error"]
            else:
                res.update(run_bench(binary, gguf, contexts, batches, args.new_tokens, args.threads))
        if res.get("kv_bytes_per_token"):
            budget = int(args.kv_budget_gib * 2**30)
            res["largest_batch"] = {c: largest_batch(budget, res["kv_bytes_per_token"], c, args.new_tokens)
                                    for c in contexts}
        results.append(res)
        print(json.dumps(res, indent=1), flush=True)
    report = {"llama_cpp_python": version, "llama_cpp_commit": lc.tree_commit(tree), "type": args.type,
              "load": os.getloadavg(), "results": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
