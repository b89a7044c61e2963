#!/usr/bin/env python
"""Decode speed and KV-cache size of Hugging Face checkpoints in stock llama.cpp (`llama-batched-bench`).

For each MODEL_DIR: the same llama.cpp as ``llama_cpp.py`` (the ``llama-cpp-python`` sdist's vendored
tree, built once under ``~/.cache/attnkit/llama.cpp/<version>/build``; this script adds the
``llama-batched-bench`` target), the checkpoint converted to GGUF with that tree's own converter
(``--type``, default f16), then::

    llama-batched-bench -m M.gguf -c B_max*(P_max+T) -npp P,... -ntg T -npl B,... -pps --output-format jsonl -lv 4

``-pps``: each prompt is prefilled once and its cache copied to the B sequences (the cache is not unified,
so every sequence holds and reads its own copy): decode at batch B over P-token contexts without paying B
prefills. Reported per (P, B): decode tokens/s (``speed_tg``), prefill tokens/s, and the KV cache llama.cpp
allocates per token, from which the largest batch that a fixed cache budget (``--kv-budget-gib``) holds at
each context follows, and each model's capacity against the first (cached tokens in the same memory).

The cache size comes from the library's log line (llama.cpp 0c1e570, ``src/llama-kv-cache.cpp``)::

    llama_kv_cache: size = 2080.00 MiB ( 16640 cells,   4 layers, 16/16 seqs), K (f16): 1040.00 MiB, V (f16): 1040.00 MiB

``cells`` are per stream and ``16/16`` is n_seq_max/n_stream (a non-unified cache has one stream per
sequence), so the cache holds cells x streams tokens; llama.cpp pads each sequence's cells to a multiple of
256, so that is not ``-c``. The library logs at INFO, which its tools map to verbosity 4 (trace) while the
default threshold is 3: without ``-lv 4`` the line is not printed at all.

``--kv-only`` runs the same ``-c`` and ``-npl`` with a 128-token prompt and 4 new tokens (the cache is
allocated for ``-c`` whatever the prompt), records only the cache fields, and when ``--out`` exists already
adds them to its results of the same models, leaving their timings alone.

Usage::

    python benchmarks/engines/llama_cpp_bench.py SRC_DIR MLA_DIR --contexts 2048,8192,16384 --batches 1,16 \\
        --out results.json
    python benchmarks/engines/llama_cpp_bench.py SRC_DIR MLA_DIR --contexts 2048,8192,16384 --batches 1,16 \
        --new-tokens 16 --kv-only --out results.json
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


KV_LINE = re.compile(
    r"llama_kv_cache: size =\s*([0-9.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\), "
    r"K \((\w+)\):\s*([0-9.]+) MiB, V \((\w+)\):\s*([0-9.]+) MiB")


def parse_kv_caches(text: str) -> list[dict]:
    """Every `llama_kv_cache: size = ...` line (one per cache; a model with sliding-window layers has two)."""
    out = []
    for m in KV_LINE.finditer(text):
        size, cells, layers, seqs, streams, k_type, k_mib, v_type, v_mib = m.groups()
        out.append({"size_mib": float(size), "cells": int(cells), "layers": int(layers), "seqs": int(seqs),
                    "streams": int(streams), "k_type": k_type, "k_mib": float(k_mib), "v_type": v_type,
                    "v_mib": float(v_mib), "tokens": int(cells) * int(streams),
                    "bytes": int(round(float(size) * 2**20))})
    return out


def parse_kv_bytes(text: str) -> int | None:
    """Bytes of the KV cache llama.cpp allocated, summed over its caches; None when no size line was printed."""
    caches = parse_kv_caches(text)
    return sum(c["bytes"] for c in caches) if caches else None


def kv_bytes_per_token(text: str) -> float | None:
    """Bytes one cached token takes: each cache's bytes over the tokens it holds (cells x streams), summed."""
    caches = parse_kv_caches(text)
    return sum(c["bytes"] / c["tokens"] for c in caches) if caches else None


def largest_batch(budget_bytes: int, bytes_per_token: float, context: int, new_tokens: int) -> int:
    """How many sequences of `context` + `new_tokens` tokens a cache of `budget_bytes` holds."""
    return int(budget_bytes // (bytes_per_token * (context + new_tokens)))


def run_bench(binary: Path, gguf: Path, contexts: list[int], batches: list[int], new_tokens: int,
              threads: int | None, kv_only: bool = False) -> dict:
    n_ctx = max(batches) * (max(contexts) + new_tokens)
    prompts, tokens = ("128", "4") if kv_only else (",".join(map(str, contexts)), str(new_tokens))
    args = ["-c", str(n_ctx), "-b", "2048", "-ub", "512", "-npp", prompts, "-ntg", tokens,
            "-npl", ",".join(map(str, batches)), "-pps", "--output-format", "jsonl", "-lv", "4",
            *(["-t", str(threads)] if threads else [])]
    lc = _load("bench_llama_cpp", "llama_cpp.py")
    r = lc._run([str(binary), "-m", str(gguf), *args])
    text = r.stdout + r.stderr
    command = " ".join([binary.name, "-m", gguf.name, *args])  # no local paths in the results
    out = {"kv_command" if kv_only else "command": command, "n_ctx": n_ctx}
    if r.returncode != 0:
        out["error"] = lc.first_error_line(text)
        return out
    caches = parse_kv_caches(text)
    out.update({"kv_cache": caches, "kv_cache_bytes": parse_kv_bytes(text),
                "kv_bytes_per_token": kv_bytes_per_token(text)})
    if not kv_only:
        out["rows"] = [{k: row[k] for k in ("pp", "tg", "pl", "speed_pp", "speed_tg", "t_pp", "t_tg")}
                       for row in parse_jsonl_rows(text)]
    return out


def add_capacity(results: list[dict], contexts: list[int], new_tokens: int, budget_gib: float) -> None:
    """Per result: the largest batch a `budget_gib` cache holds at each context, and the cached tokens it holds
    in the same memory as the first model (its bytes per token over this one's)."""
    first = results[0].get("kv_bytes_per_token") if results else None
    budget = int(budget_gib * 2**30)
    for res in results:
        bpt = res.get("kv_bytes_per_token")
        if not bpt:
            continue
        res["largest_batch"] = {c: largest_batch(budget, bpt, c, new_tokens) for c in contexts}
        res["kv_budget_gib"] = budget_gib
        if first:
            res["kv_capacity_vs_first"] = first / bpt


KV_FIELDS = ("kv_command", "kv_cache", "kv_cache_bytes", "kv_bytes_per_token", "largest_batch", "kv_budget_gib",
             "kv_capacity_vs_first")


def merge_kv(report: dict, kv_results: list[dict]) -> dict:
    """`report` with the KV fields of `kv_results` set on its results of the same models (timings untouched)."""
    by_model = {r["model"]: r for r in kv_results}
    for res in report.get("results", []):
        new = by_model.get(res.get("model"))
        if new is None:
            continue
        for key in KV_FIELDS:
            if key in new:
                res[key] = new[key]
            elif key in res and key != "kv_command":
                res[key] = None  # a stale value from another measurement would be worse than none
    return report


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
    ap.add_argument("--kv-only", action="store_true",
                    help="measure only the cache llama.cpp allocates (same -c and -npl, a short prompt); "
                         "merged into --out when it exists")
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
                res.update(run_bench(binary, gguf, contexts, batches, args.new_tokens, args.threads,
                                     kv_only=args.kv_only))
        results.append(res)
    add_capacity(results, contexts, args.new_tokens, args.kv_budget_gib)
    for res in results:
        print(json.dumps(res, indent=1), flush=True)
    report = {"llama_cpp_python": version, "llama_cpp_commit": lc.tree_commit(tree), "type": args.type,
              "load": os.getloadavg(), "results": results}
    if args.kv_only and args.out and args.out.exists():
        old = json.loads(args.out.read_text())
        if old.get("llama_cpp_commit") != report["llama_cpp_commit"] or old.get("type") != args.type:
            raise SystemExit(f"{args.out} was measured with another llama.cpp or GGUF type; not merging")
        report = merge_kv(old, results)
        report["kv_only_load"] = os.getloadavg()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
