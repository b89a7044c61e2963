"""Write the tables of docs/results.md that come from recorded JSON files.

    python benchmarks/results_md.py           # rewrite the generated tables in docs/results.md
    python benchmarks/results_md.py --check   # exit 1 if docs/results.md is not what this script writes

Each generated table sits between two marker comments in docs/results.md,

    <!-- results_md: NAME -->
    ...
    <!-- /results_md: NAME -->

and is built only from JSON files under benchmarks/results/ and benchmarks/engines/results/ (no number is
typed in here). Text outside the markers is left as it is, so the page's prose is edited by hand and the
tables by this script. Running it twice changes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "results.md"
RESULTS = ROOT / "benchmarks" / "results"
ENGINES = ROOT / "benchmarks" / "engines" / "results"
ASSETS = ROOT / "attnkit" / "assets"


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _folder(model: str) -> str:
    """A model folder as a command names it: a bundled model under attnkit/assets, else out/NAME."""
    name = Path(model).name
    return f"attnkit/assets/{name}" if (ASSETS / name).is_dir() else f"out/{name}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"×{value:.6f}"


def _ppl(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def _error(text: str) -> str:
    line = text.strip().splitlines()[-1]
    line = line.split("Value error, ")[-1]  # pydantic's wrapper around vLLM's own message
    return "refused: " + line.replace("|", "\\|")[:110]


# ---------------------------------------------------------------- sections


def engines_ppl() -> list[str]:
    """Perplexity of the same checkpoint in a stock engine and in transformers, same windows."""
    rows, commands = [], []
    for path in sorted(ENGINES.glob("llama_cpp_*.json")):
        data = _load(path)
        if "meta" not in data:  # the decode benchmark (engines_decode)
            continue
        meta = data["meta"]
        models = []
        for result in data["results"]:
            models.append(_folder(result["model"]))
            hf = (result.get("transformers") or {}).get("ppl")
            for gguf_type, run in (result.get("types") or {}).items():
                engine = _error(run["error"]) if "error" in run else _ppl(run.get("ppl"))
                rows.append([Path(result["model"]).name, "llama.cpp", gguf_type, _ppl(hf), engine,
                             _ratio(run.get("ratio")), "", f"`{path.name}`"])
        commands.append(f"python benchmarks/engines/llama_cpp.py {' '.join(models)} "
                        f"--types {','.join(meta['types'])} --ctx {meta['ctx']} --out {_rel(path)}")
    for path in sorted(ENGINES.glob("vllm_*.json")):
        data = _load(path)
        if "meta" not in data:
            continue
        meta = data["meta"]
        env = {k: v for k, v in meta.get("env", {}).items()
               if k not in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "VLLM_ENABLE_V1_MULTIPROCESSING",
                            "VLLM_CPU_KVCACHE_SPACE")}
        models = []
        for result in data["results"]:
            models.append(_folder(result["model"]))
            vllm = result.get("vllm") or {}
            engine = _error(result["error"]) if "error" in result else _ppl(result.get("ppl_vllm"))
            greedy = result.get("greedy") or {}
            equal = f"{greedy['equal']}/{greedy['prompts']}" if "equal" in greedy else ""
            backend = "+".join(vllm.get("attention_backends") or []) or "—"
            rows.append([result["model"], f"vLLM ({backend})", meta["dtype"],
                         _ppl(result.get("ppl_transformers")), engine, _ratio(result.get("ratio")), equal,
                         f"`{path.name}`"])
        flags = f" --dtype {meta['dtype']}"
        if meta.get("hf_dtype") and meta["hf_dtype"] != meta["dtype"]:
            flags += f" --hf-dtype {meta['hf_dtype']}"
        flags += "".join(f" --env {k}={v}" for k, v in env.items())
        commands.append(f"python benchmarks/engines/vllm_cpu.py {' '.join(models)}{flags} "
                        f"--ctx {meta['ctx']} --windows {meta['windows']} --out {_rel(path)}")
    header = ["model", "engine", "type", "transformers ppl", "engine ppl", "engine ÷ transformers",
              "greedy equal", "JSON"]
    return _table(header, rows) + ["", "Commands (one per JSON):", "", "```"] + commands + ["```"]


VLLM_BENCH_COMMAND = ("python benchmarks/engines/vllm_cpu.py attnkit/assets/reference-mha out/mha-mla512 --bench "
                      "--contexts 2048,8192 --batches 1,16 --bench-tokens 16 --max-model-len 16384 "
                      "--dtype float32 --env VLLM_CPU_KVCACHE_SPACE=5 --profile\n"
                      "# 16K: the same with --contexts 16128 --warmup-context 1024 --nice 0 (one model per run)")


def engines_decode() -> list[str]:
    """Decode tokens/s of reference-mha and its 512/64 MLA output in the two engines."""
    lines = []
    path = ENGINES / "llama_cpp_bench_reference_mha.json"
    data = _load(path)
    source, mla = data["results"]
    rows = []
    for a, b in zip(source["rows"], mla["rows"]):
        rows.append([f"{a['pp']:,}", str(a["pl"]), f"{a['speed_tg']:.1f}", f"{b['speed_tg']:.1f}",
                     f"×{b['speed_tg'] / a['speed_tg']:.2f}", f"{a['speed_pp']:.0f} / {b['speed_pp']:.0f}"])
    lines += [f"llama.cpp ({data['type']} GGUF, commit {data['llama_cpp_commit'][:7]}), `{path.name}`; KV bytes "
              f"per token {source['kv_bytes_per_token']:,.0f} (source) and {mla['kv_bytes_per_token']:,.0f} (MLA):",
              ""]
    lines += _table(["context", "batch", f"{source['model']} decode tok/s", f"{mla['model']} decode tok/s",
                     "MLA ÷ source", "prefill tok/s, source / MLA"], rows)
    contexts = ",".join(str(pp) for pp in dict.fromkeys(r["pp"] for r in source["rows"]))
    batches = ",".join(str(pl) for pl in dict.fromkeys(r["pl"] for r in source["rows"]))
    new_tokens = source["rows"][0]["tg"]
    lines += ["", "```",
              f"python benchmarks/engines/llama_cpp_bench.py {_folder(source['model'])} {_folder(mla['model'])} "
              f"--type {data['type']} --contexts {contexts} --batches {batches} --new-tokens {new_tokens} --kv-only "
              f"--out {_rel(path)}", "```", ""]

    path = ENGINES / "vllm_bench_reference_mha.json"
    data = _load(path)
    src_runs = {(r["context"], r["batch"]): r for key in ("source_unshared", "source_16k")
                for r in data[key]["results"][0]["runs"] if r.get("decode_tok_s") and not r.get("error")}
    mla_runs = [*data["mla_runs_from_status_lines"]["runs"], *data["mla_16k_batch1"]["results"][0]["runs"]]
    rows = []
    for r in mla_runs:
        s = src_runs.get((r["context"], r["batch"]))
        if s is None:
            continue
        rows.append([f"{r['context']:,}", str(r["batch"]), f"{s['decode_tok_s']:.1f}", f"{r['decode_tok_s']:.1f}",
                     f"×{r['decode_tok_s'] / s['decode_tok_s']:.2f}",
                     f"{s['max_batch_that_fits']} / {r['max_batch_that_fits']}"])
    oom = data["mla_16k_batch16_oom"]
    s16 = src_runs[(16128, 16)]
    rows.append(["16,128", "16", f"{s16['decode_tok_s']:.1f}", "killed (out of memory in prefill)", "—",
                 f"{s16['max_batch_that_fits']} / {data['mla_16k_batch1']['results'][0]['runs'][0]['max_batch_that_fits']}"])
    vllm = data["source_unshared"]["meta"]["venv"]["vllm"]
    lines += [f"{vllm} ({data['source_unshared']['meta']['dtype']}), `{path.name}` (sections `source_unshared`, "
              "`source_16k`, `mla_runs_from_status_lines`, `mla_16k_batch1`; the 16K × 16 MLA run was killed: "
              f"{oom['why']}):", ""]
    lines += _table(["context", "batch", "source decode tok/s", "MLA 512/64 decode tok/s", "MLA ÷ source",
                     "largest batch in the KV pool, source / MLA"], rows)
    return lines + ["", "```", VLLM_BENCH_COMMAND, "```"]


def qknorm_fold_bound() -> list[str]:
    path = RESULTS / "qknorm_fold_bound.json"
    data = _load(path)
    rows = [[r["queries"], r["keys"], f"{r['ppl']:.2f}", f"×{r['x_source']:.3f}"] for r in data["rows"]]
    model = Path(data["model"]).name
    return ([f"`{model}`, {data['held_out_tokens']:,} held-out tokens, `{path.name}`:", ""]
            + _table(["queries' norm", "keys' norm", "held-out ppl", "× source"], rows)
            + ["", "```", f"python benchmarks/qknorm_fold_bound.py --out {_rel(path)}", "```"])


def dex_adapt() -> list[str]:
    path = RESULTS / "dex_adapt.json"
    data = _load(path)
    s = data["settings"]
    rows = []
    for arm, r in data["arms"].items():
        ev = r.get("lm_eval") or {}
        rows.append([arm, f"{r['trainable_params']:,}", str(r["steps"]), f"{r['ppl']:.2f}",
                     f"{ev.get('attnkit-ppl', {}).get('token_perplexity', float('nan')):.2f}",
                     f"{ev.get('attnkit-recall-256', {}).get('acc', float('nan')):.2f}"])
    command = (f"python benchmarks/dex_adapt.py --from-run {s['from_run']} --arms {s['arms']} --tokens {s['tokens']} "
               f"--seq-len {s['seq_len']} --batch {s['batch']} --eval-rows {s['eval_rows']} "
               f"--eval-limit {s['eval_limit']} --out {s['out']}")
    return ([f"`{s['model']}`, {data['train_tokens']:,} training tokens, `{path.name}`:", ""]
            + _table(["arm", "trainable parameters", "steps", "held-out ppl", "attnkit-ppl",
                      f"recall-256 ({s['eval_limit']} items)"], rows)
            + ["", "```", command, "```"])


def fsdp_cpu() -> list[str]:
    lines = []
    for name in ("fsdp_cpu.json", "fsdp_cpu_wide.json"):
        data = _load(RESULTS / name)
        summary = data["summary"]
        mem = summary["memory_mib"]
        peaks = {arm: max(p["train_peak_rss"] for p in procs) for arm, procs in mem.items()}
        cells = [f"`{name}`", data["student_made_by"].replace("|", "\\|"),
                 f"{summary['fsdp_vs_ddp_max_loss_diff']:.1e}",
                 ", ".join(f"{arm} {peak:,.0f}" for arm, peak in peaks.items())]
        if "resumed_vs_uninterrupted_max_loss_diff" in summary:
            cells.append(f"{summary['resumed_vs_uninterrupted_max_loss_diff']:.1e}")
        else:
            cells.append("not run")
        lines.append(cells)
    commands = [_load(RESULTS / n)["command"] for n in ("fsdp_cpu.json", "fsdp_cpu_wide.json")]
    return (_table(["JSON", "student", "max per-step loss difference, FSDP vs DDP",
                    "training peak RSS per process (MiB)", "killed + resumed vs uninterrupted"], lines)
            + ["", "```"] + commands + ["```"])


SECTIONS = {
    "engines-ppl": engines_ppl,
    "engines-decode": engines_decode,
    "qknorm-fold-bound": qknorm_fold_bound,
    "dex-adapt": dex_adapt,
    "fsdp-cpu": fsdp_cpu,
}


def render(text: str) -> str:
    for name, build in SECTIONS.items():
        begin, end = f"<!-- results_md: {name} -->", f"<!-- /results_md: {name} -->"
        if text.count(begin) != 1 or text.count(end) != 1:
            raise SystemExit(f"docs/results.md: expected one {begin} and one {end}")
        head, rest = text.split(begin)
        _, tail = rest.split(end)
        text = head + begin + "\n" + "\n".join(build()) + "\n" + end + tail
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is stale; write nothing")
    ap.add_argument("--page", type=Path, default=PAGE)
    args = ap.parse_args(argv)
    old = args.page.read_text(encoding="utf-8")
    new = render(old)
    if args.check:
        if new != old:
            print(f"{args.page} is stale: run python benchmarks/results_md.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        args.page.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
