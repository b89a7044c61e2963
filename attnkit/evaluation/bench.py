"""`attnkit bench`: prefill / decode speed, peak memory and KV-cache bytes per context length and batch.

Each (context C, batch) case, `--repeats` times: prefill `batch × (C - n)` random tokens (one forward,
timed), then n = `--decode-tokens` greedy steps through the cache (timed; the attention modules timed
separately by hooks), so decoding ends exactly at context C. KV bytes come from the cache object (`attnkit.evaluation.kv`), the decode lower bound from a copy
benchmark run in the same process (`attnkit.evaluation.membw`). MLA models run the absorbed attention
(`attnkit.adapters.mla`) unless `--attn expanded`; other models run their plain path, and say so.
"""

from __future__ import annotations

import gc
import inspect
import json
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from attnkit.errors import AttnkitError
from attnkit.evaluation.kv import (cache_bytes, cache_keyword, checkpoint_dtype, kv_as_stored, kv_cache_bytes_per_token,
                                  returned_cache, short_dtype)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def stats(values: list[float]) -> dict:
    """Median and spread ((max - min) / median) of repeated measurements."""
    v = sorted(values)
    mid = len(v) // 2
    median = v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2
    return {"median": median, "min": v[0], "max": v[-1], "spread": (v[-1] - v[0]) / median if median else 0.0,
            "values": values}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """Peak memory over a block: torch.cuda.max_memory_allocated on CUDA, sampled process RSS on CPU."""

    def __init__(self, device: torch.device, interval_s: float = 0.02):
        self.device, self.interval, self.peak = device, interval_s, 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, proc.memory_info().rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak = psutil.Process().memory_info().rss
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, psutil.Process().memory_info().rss)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class AttentionTimer:
    """Time spent inside the decoder layers' `self_attn` modules while `enabled`; `clock` is the clock
    every measurement of the run uses (wall, or process CPU time: robust on a shared, oversubscribed CPU)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, clock=time.perf_counter):
        self.device, self.enabled, self.total, self._t0, self.clock = device, False, 0.0, 0.0, clock
        mods = [m for name, m in model.named_modules() if name.endswith("self_attn")]
        self.weight_bytes = sum(p.numel() * p.element_size() for m in mods for p in m.parameters())
        self._handles = [h for m in mods for h in (m.register_forward_pre_hook(self._pre),
                                                  m.register_forward_hook(self._post))]

    def _pre(self, *_):
        if self.enabled:
            sync(self.device)
            self._t0 = self.clock()

    def _post(self, *_):
        if self.enabled:
            sync(self.device)
            self.total += self.clock() - self._t0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _forward_kwargs(model: torch.nn.Module) -> tuple[str, bool]:
    """The cache keyword this model's forward takes and logits_to_keep support."""
    return cache_keyword(model), "logits_to_keep" in inspect.signature(model.forward).parameters


@torch.no_grad()
def measure_once(model, ids: torch.Tensor, decode_tokens: int, timer: AttentionTimer, bandwidth: float,
                 chunk: int = 0) -> dict:
    """Prefill `ids` [B, T] (in chunks of `chunk` tokens if > 0), then `decode_tokens` greedy steps;
    times, cache bytes, attention time vs the cache-read bound."""
    device = ids.device
    cache_kw, keep = _forward_kwargs(model)
    extra = {"logits_to_keep": 1} if keep else {}
    batch, prompt = ids.shape
    step = chunk if chunk > 0 else prompt
    cache = None
    clock = timer.clock
    sync(device)
    t0 = clock()
    for start in range(0, prompt, step):
        past = {cache_kw: cache} if cache is not None else {}
        out = model(input_ids=ids[:, start : start + step], use_cache=True, **past, **extra)
        cache = returned_cache(out)
    sync(device)
    prefill_s = clock() - t0
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
    del out
    timer.total, timer.enabled = 0.0, True
    t0 = clock()
    for _ in range(decode_tokens):
        logits = model(input_ids=nxt, use_cache=True, **{cache_kw: cache}).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    decode_s = clock() - t0
    timer.enabled = False
    stored = sum(cache_bytes(cache))
    allocated = sum(getattr(layer, "allocated_bytes", lambda: 0)() or 0 for layer in getattr(cache, "layers", []))
    per_token = stored / (batch * (prompt + decode_tokens))
    # step i attends over prompt + i + 1 tokens: reading them once is the floor for its attention
    read = per_token * batch * sum(prompt + i + 1 for i in range(decode_tokens))
    return {
        "prefill_s": prefill_s, "decode_s": decode_s, "attention_s": timer.total,
        "kv_cache_bytes": stored, "kv_cache_allocated_bytes": allocated or stored,
        "kv_cache_bytes_per_token": per_token, "attention_lower_bound_s": read / bandwidth,
        "attention_weights_bound_s": (read + decode_tokens * timer.weight_bytes) / bandwidth,
    }


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def estimate_bytes(config, kv_per_token: int, batch: int, tokens: int, dtype_bytes: int, score_rows: int = 0) -> int:
    """Rough working set of a case: the cache plus one layer's prefill activations (for a CPU pre-check),
    plus materialised [H, rows, S] attention scores when the path has them (transformers' DeepSeek-V3:
    its V head dim differs from Q/K's, so SDPA on CPU falls back to the math kernel)."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head = getattr(config, "qk_nope_head_dim", None)
    per_head = (head + config.qk_rope_head_dim + config.v_head_dim) if head else 3 * (hidden // heads)
    act = hidden * 4 + heads * per_head + 3 * getattr(config, "intermediate_size", 4 * hidden)
    scores = 3 * batch * heads * score_rows * tokens * 4  # scores, softmax, their fp32 copies
    return kv_per_token * batch * tokens + act * batch * tokens * dtype_bytes + scores


def run_case(model, info: dict, context: int, batch: int, args, timer, bandwidth, device) -> dict:
    """All repeats of one (context, batch) case; an out-of-memory is recorded, not raised."""
    row: dict = {"context": context, "batch": batch}
    config = model.config
    rows = (args.prefill_chunk or context) if info["mla"] and info["attn"] == "expanded" else 0
    need = estimate_bytes(config, info["kv_cache_measured"]["bytes_per_token"], batch, context,
                          next(model.parameters()).element_size(), rows)
    if device.type == "cpu" and need > psutil.virtual_memory().available:
        row.update(status="oom", error=f"predicted working set {need / 2**30:.1f} GiB exceeds available memory")
        return row
    gen = torch.Generator().manual_seed(context * 31 + batch)
    vocab = int(config.vocab_size)
    runs, peaks = [], []
    try:
        for _ in range(args.repeats):
            ids = torch.randint(1, vocab, (batch, context - args.decode_tokens), generator=gen).to(device)
            with PeakMemory(device) as peak:
                runs.append(measure_once(model, ids, args.decode_tokens, timer, bandwidth, args.prefill_chunk))
            peaks.append(peak.peak / 2**20)
    except Exception as exc:  # noqa: BLE001 - only OOM is swallowed, re-raised otherwise
        timer.enabled = False
        if not is_oom(exc):
            raise
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row.update(status="oom", error=str(exc).splitlines()[0][:200])
        return row
    last = runs[-1]
    attn = stats([r["attention_s"] for r in runs])
    row.update(
        status="ok",
        prefill_tokens_per_s=stats([batch * (context - args.decode_tokens) / r["prefill_s"] for r in runs]),
        decode_tokens_per_s=stats([batch * args.decode_tokens / r["decode_s"] for r in runs]),
        decode_ms_per_step=stats([1e3 * r["decode_s"] / args.decode_tokens for r in runs]),
        peak_memory_mb=stats(peaks),
        kv_cache_bytes=last["kv_cache_bytes"],
        kv_cache_allocated_bytes=last["kv_cache_allocated_bytes"],
        kv_cache_bytes_per_token=last["kv_cache_bytes_per_token"],
        kv_cache_tokens=batch * context,
        attention_decode_s=attn,
        attention_lower_bound_s=last["attention_lower_bound_s"],
        attention_vs_bound=attn["median"] / last["attention_lower_bound_s"],
        attention_weights_bound_s=last["attention_weights_bound_s"],
        attention_vs_bound_with_weights=attn["median"] / last["attention_weights_bound_s"],
    )
    return row


def label_of(spec) -> str:
    """A MODEL spec's name in the table and JSON: the spec itself, or for an in-memory model its class and
    where it was loaded from."""
    if isinstance(spec, str):
        return spec
    origin = getattr(getattr(spec, "config", None), "name_or_path", "") or "in memory"
    return f"{type(spec).__name__} ({origin})"


def resolve(spec, args) -> tuple[Path | None, dict]:
    """Resolve MODEL and check the requested contexts against its config, before loading any weights.
    An in-memory model (the Python API) has no folder: its config is read from it."""
    from attnkit.converters.shapes import check_weights
    from attnkit.io.resolve import check_causal_lm, resolve_model

    if isinstance(spec, str):
        path = resolve_model(spec)
        raw = check_causal_lm(path)
        check_weights(path, raw, required=False, where=f"cannot load {spec}")  # one line, not transformers' load report
    else:
        path, raw = None, spec.config.to_dict()
    text = raw.get("text_config") or raw
    check_contexts(label_of(spec), text.get("max_position_embeddings"), args.context, args.decode_tokens)
    return path, raw


def load_model(spec, path: Path | None, raw: dict, attn: str, dtype: torch.dtype, device: torch.device) -> tuple:
    """Load MODEL; switch MLA models to the requested attention path. An in-memory model is used as it
    is (the API checked that it already is in `dtype` on `device`)."""
    from transformers import AutoModelForCausalLM

    from attnkit.adapters.mla import enable_absorbed, is_mla

    if path is None:
        model = spec
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=bool(raw.get("auto_map")))
        model.to(device)
    model.eval()
    mla = is_mla(model)
    if mla and attn != "expanded":
        enable_absorbed(model, attn)
        path_name = f"absorbed MLA (attnkit, mode {attn})"
    elif mla:
        path_name = "expanded MLA (transformers DeepseekV3Attention)"
    else:
        path_name = "plain (not an MLA model: its own attention, --attn does not apply)"
    info = {"name": label_of(spec), "path": None if path is None else str(path), "model_type": raw.get("model_type"), "mla": mla, "attn": attn,
            "attn_path": path_name,
            "dtype": str(dtype).replace("torch.", ""), "params": sum(p.numel() for p in model.parameters()),
            "max_position_embeddings": getattr(model.config, "max_position_embeddings", None),
            "load": {"trust_remote_code": bool(raw.get("auto_map"))}}
    return model, info


def check_contexts(name: str, limit: int | None, contexts: list[int], decode_tokens: int) -> None:
    """Refuse context lengths the model cannot address, before any measurement."""
    if any(c <= decode_tokens for c in contexts):
        raise AttnkitError(f"every --context must exceed --decode-tokens ({decode_tokens}): decoding ends at the context length")
    too_long = [c for c in contexts if limit and c > limit]
    if too_long:
        raise AttnkitError(
            f"--context {','.join(map(str, too_long))} exceeds {name}'s max_position_embeddings {limit}; "
            f"use context lengths up to {limit}"
        )


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise AttnkitError("--device cuda requested but no CUDA device is available")
    if not (name == "cpu" or name.startswith("cuda")):
        raise AttnkitError(f"--device must be cpu or cuda, not {name!r}")
    return torch.device(name)


def warm_up(model, device: torch.device, timer: AttentionTimer) -> None:
    """One small untimed prefill + decode, so one-time costs (allocator, kernels) stay out of the first case."""
    ids = torch.randint(1, int(model.config.vocab_size), (1, 16)).to(device)
    measure_once(model, ids, 2, timer, 1.0)


def case_weight(raw: dict, context: int, batch: int, decode_tokens: int) -> float:
    """A case's share of the progress bar: its arithmetic, roughly. Per token the weights cost about
    2·P FLOPs and attention over t earlier tokens 4·L·H·d·t, so a prefill of c tokens plus the decode
    costs ∝ batch · n · (1 + n·L·H·d / P) with n = c + decode tokens (P from the config). Why: counted
    as one case each, a 16K context — hundreds of times a 1K one's work — made the ETA useless."""
    text = raw.get("text_config") or raw
    D, L = int(text.get("hidden_size", 1)), int(text.get("num_hidden_layers", 1))
    H = int(text.get("num_attention_heads", 1))
    d = int(text.get("head_dim") or D // max(H, 1))
    inter = int(text.get("intermediate_size") or 4 * D)
    params = L * (4 * D * D + 3 * D * inter)  # attention + gated MLP, no embeddings
    n = context + decode_tokens
    return batch * n * (1 + n * L * H * d / max(params, 1))


def bench_model(spec, path: Path | None, raw: dict, attn: str, args, device, dtype, bandwidth: float, progress) -> dict:
    model, info = load_model(spec, path, raw, attn, dtype, device)
    if not info["mla"]:
        print(f"attnkit bench: {info['name']} is not an MLA model; measuring its plain attention path", file=sys.stderr)
    kv = kv_cache_bytes_per_token(model)  # in the dtype this run loaded the model in (--dtype)
    stored = kv_as_stored(kv["total"], kv["dtype"], (path and checkpoint_dtype(path)) or kv["dtype"])
    measured = {"bytes_per_token": kv["total"], **{k: v for k, v in kv.items() if k != "total"}, "dtype": short_dtype(kv["dtype"])}
    # bytes/token as convert and eval count them (in the stored dtype, kv.py), then what this run's cache held
    info.update(kv_cache_bytes_per_token=stored["bytes_per_token"], kv_cache_dtype=stored["dtype"], kv_cache_measured=measured)
    clock = CLOCKS["wall" if device.type == "cuda" else getattr(args, "clock", "wall")]
    timer = AttentionTimer(model, device, clock)
    warm_up(model, device, timer)
    info["results"] = []
    for context in args.context:
        for batch in args.batch:
            progress.set_postfix_str(f"{info['name']} ctx={context} batch={batch}")
            info["results"].append(run_case(model, info, context, batch, args, timer, bandwidth, device))
            progress.update(case_weight(raw, context, batch, args.decode_tokens))
    timer.remove()
    del model
    gc.collect()
    return info


def main(args) -> int:
    """The `attnkit bench` handler."""
    measure(args)
    return 0


def measure(args) -> dict:
    """Benchmark, print the table, write --out; returns the results (threads restored afterwards, so
    in-process callers are unaffected)."""
    threads = torch.get_num_threads()
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    try:
        return _measure(args)
    finally:
        torch.set_num_threads(threads)


def _measure(args) -> dict:
    from tqdm.auto import tqdm

    from attnkit import __version__
    from attnkit.evaluation.bench_report import compare, format_table, write_plot
    from attnkit.evaluation.membw import copy_bandwidth

    if args.repeats < 1 or args.decode_tokens < 1:
        raise AttnkitError("--repeats and --decode-tokens must be at least 1")
    if any(b <= 0 for b in args.batch):
        raise AttnkitError("--batch values must be positive")
    device, dtype = pick_device(args.device), DTYPES[args.dtype]
    if args.out and Path(args.out).suffix != ".json":
        raise AttnkitError(f"--out must name a .json file, not {args.out}")
    if args.out:
        from attnkit.io.checkpoint import check_results_file

        check_results_file(Path(args.out), "attnkit.bench/v1", "bench")
        png = Path(args.out).with_suffix(".png")
        if png.exists() and not Path(args.out).is_file():  # beside no results of ours: someone else's picture
            raise AttnkitError(f"{png} exists and was not written by an earlier `attnkit bench --out {args.out}`; "
                               "give another --out name")
    specs = [("model", args.model, args.attn)]
    if args.baseline:
        specs.append(("baseline", args.baseline, getattr(args, "baseline_attn", None) or args.attn))
    specs = [(label, spec, attn, *resolve(spec, args)) for label, spec, attn in specs]
    clock = "wall" if device.type == "cuda" else getattr(args, "clock", "wall")
    bw = copy_bandwidth(device, clock=CLOCKS[clock])
    result = {
        "schema": "attnkit.bench/v1", "attnkit_version": __version__, "clock": clock,
        "settings": {**{k: v for k, v in vars(args).items() if k != "func" and not callable(v)},
                     "model": label_of(args.model),  # an in-memory model (callable) by its name
                     "baseline": None if args.baseline is None else label_of(args.baseline)},
        "machine": {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "cpu_count": psutil.cpu_count(), "memory_bandwidth": bw},
        "models": {},
    }
    total = sum(case_weight(raw, c, b, args.decode_tokens) for *_, raw in specs for c in args.context for b in args.batch)
    with tqdm(total=total, desc="bench", bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]{postfix}") as progress:
        for label, spec, attn, path, raw in specs:
            result["models"][label] = bench_model(spec, path, raw, attn, args, device, dtype, bw["bytes_per_s"], progress)
    if args.baseline:
        result["comparison"] = compare(result["models"]["model"], result["models"]["baseline"])
    print(format_table(result))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(out)
        png = write_plot(result, out.with_suffix(".png"))
        print(f"wrote {out} and {png}")
    return result
