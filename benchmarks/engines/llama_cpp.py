#!/usr/bin/env python
"""Verify a Hugging Face checkpoint folder in stock llama.cpp, against transformers.

What it does, for each MODEL_DIR:

1. Gets llama.cpp the way a user of the Python bindings gets it: the ``llama-cpp-python`` sdist from
   PyPI (``pip download --no-deps --no-binary :all:``), whose ``vendor/llama.cpp`` is a full llama.cpp
   tree. It is unpacked and built once (CPU only, cmake, the targets ``llama-perplexity``,
   ``llama-tokenize`` and ``llama-quantize``) under ``~/.cache/attnkit/llama.cpp/<version>/`` and reused.
2. Converts the folder to GGUF with that tree's own ``convert_hf_to_gguf.py`` (f32, f16, q8_0).
   The converter identifies a BPE pre-tokenizer by hashing how it tokenises a fixed string; the hash
   of a tokenizer it has never seen (attnkit's reference tokenizer) makes it refuse. This script
   registers the hash AT RUN TIME: it runs the converter in a child Python process after wrapping
   ``TextModel.get_vocab_base_pre`` so that an unknown hash maps to the pre-tokenizer named by
   ``--pre-tokenizer`` (default: derived from tokenizer.json; a plain byte-level BPE with the GPT-2
   split regex is llama.cpp's ``gpt-2``). No file of llama.cpp is edited.
3. Tokenises the held-out text with llama.cpp (``llama-tokenize``, same options as
   ``llama-perplexity`` uses), checks the ids against the HF tokenizer, runs ``llama-perplexity`` with
   its default settings (only ``-c``), and computes transformers' perplexity over exactly the windows
   llama-perplexity scores: chunk c is tokens[c*n : (c+1)*n] (n = --ctx, as many whole chunks as the
   text holds), its first token replaced by BOS when the vocabulary adds BOS, and the tokens at
   positions n/2+1 .. n-1 scored from the logits one position earlier.

It writes a JSON (``--out``) and prints a table; a failure is reported by its first error line
(a GGML_ASSERT, a missing key, ...), never a traceback.

Usage::

    python benchmarks/engines/llama_cpp.py MODEL_DIR [MODEL_DIR ...] --types f32,f16,q8_0 --ctx 512 \
        --out results.json
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path


def _load_common():
    """benchmarks/engines/common.py, by its path (the scripts are not a package); shared by the scripts here."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common  # noqa: PLC0415

    return common


_common = _load_common()
REPO, PPL_DATA = _common.REPO, _common.PPL_DATA
log, load_text, ratio, python_error_line, fmt = (
    _common.log, _common.load_text, _common.ratio, _common.python_error_line, _common.fmt)

DEFAULT_CACHE = Path(os.environ.get("ATTNKIT_LLAMA_CPP_CACHE", "~/.cache/attnkit/llama.cpp")).expanduser()
TARGETS = ("llama-perplexity", "llama-tokenize", "llama-quantize")
TYPES = ("f32", "f16", "bf16", "q8_0")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)


# --------------------------------------------------------------------------------------------------
# pure helpers (unit-tested in tests/test_engines_script.py)


def perplexity_windows(n_tokens: int, n_ctx: int) -> list[tuple[int, int]]:
    """The chunks llama-perplexity evaluates (default, no --ppl-stride): whole n_ctx windows from
    the start of the token stream; it refuses fewer than 2*n_ctx tokens (returns [] then)."""
    if n_ctx <= 0 or n_tokens < 2 * n_ctx:
        return []
    return [(c * n_ctx, (c + 1) * n_ctx) for c in range(n_tokens // n_ctx)]


def scored_positions(n_ctx: int) -> tuple[int, int]:
    """Within a window, llama-perplexity takes the logits at positions first..n_ctx-2 (first = n_ctx/2)
    and scores the next token with each: targets are positions first+1..n_ctx-1. Returns the
    half-open range of logit positions."""
    first = n_ctx // 2
    return first, n_ctx - 1


def window_tokens(tokens: list[int], start: int, end: int, bos: int | None) -> list[int]:
    """The ids fed for one chunk: the first one replaced by BOS when the vocabulary adds BOS."""
    window = list(tokens[start:end])
    if bos is not None and window:
        window[0] = bos
    return window


_PPL_RE = re.compile(r"Final estimate: PPL = ([0-9.eE+-]+|nan|inf|-nan)")


def parse_final_ppl(text: str) -> float | None:
    m = _PPL_RE.search(text)
    if not m:
        return None
    try:
        return float(m.group(1).replace("-nan", "nan"))
    except ValueError:
        return None


def parse_chunk_ppls(text: str) -> list[float]:
    """The running estimates '[1]12.3456,[2]...' llama-perplexity prints."""
    return [float(v) if v not in ("nan", "-nan") else math.nan
            for v in re.findall(r"\[\d+\](-?nan|[0-9.]+(?:[eE][+-]?\d+)?),", text)]


_ERR_PATTERNS = (
    r"GGML_ASSERT\(.*",
    r"error loading model[^\n]*",
    r"llama_model_load: error[^\n]*",
    r"key not found[^\n]*",
    r"wrong number of tensors[^\n]*",
    r"unknown (?:model )?architecture[^\n]*",
    r"unknown pre-tokenizer type[^\n]*",
    r"you need at least \d+ tokens[^\n]*",
    r"failed to[^\n]*",
    r"error:[^\n]*",
    r"Error[^\n]*",
)


def first_error_line(text: str) -> str:
    """The first line of text that reads like llama.cpp's reason for stopping (patterns in order of
    how specific they are); else the last non-empty line."""
    for pat in _ERR_PATTERNS:
        m = re.search(pat, text)
        if m:
            return m.group(0).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def parse_context_settings(text: str) -> dict:
    """Settings llama.cpp reports when it creates the context (what 'default' meant in this run)."""
    out: dict = {}
    m = re.search(r"llama_context:\s+flash_attn\s*=\s*(\S+)", text)
    if m:
        out["flash_attn"] = m.group(1)
    m = re.search(r"Flash Attention (enabled|not supported, set to disabled)", text)
    if m:
        out["flash_attn_resolved"] = "enabled" if m.group(1) == "enabled" else "disabled"
    m = re.search(r"K \((\w+)\):", text)
    if m:
        out["cache_type_k"] = m.group(1)
    m = re.search(r"V \((\w+)\):", text)
    if m:
        out["cache_type_v"] = m.group(1)
    for key in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "causal_attn", "kv_unified"):
        m = re.search(rf"llama_context:\s+{key}\s*=\s*(\S+)", text)
        if m:
            out[key] = m.group(1)
    m = re.search(r"calculating perplexity over (\d+) chunks", text)
    if m:
        out["chunks"] = int(m.group(1))
    return out


def byte_level_pre_tokenizer(tokenizer_json: dict) -> str | None:
    """llama.cpp's name for a tokenizer.json pre-tokenizer when it is plain GPT-2 byte-level BPE
    (ByteLevel with the default regex and no normaliser): 'gpt-2'. None when not recognisable."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or tokenizer_json.get("normalizer") not in (None, {}):
        return None
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence":
        items = pre.get("pretokenizers") or []
        pre = items[0] if len(items) == 1 else {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False):
        return "gpt-2"
    return None


# --------------------------------------------------------------------------------------------------
# llama.cpp: sdist, tree, build


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, text=True, capture_output=True, **kw)


def get_sdist(cache: Path, version: str | None) -> Path:
    sd = cache / "sdist"
    sd.mkdir(parents=True, exist_ok=True)
    pattern = f"llama_cpp_python-{version}.tar.gz" if version else "llama_cpp_python-*.tar.gz"
    found = sorted(sd.glob(pattern))
    if found:
        return found[-1]
    spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    log(f"downloading the {spec} sdist from PyPI ...")
    r = _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec, "-d", str(sd)])
    if r.returncode != 0:
        raise SystemExit(f"pip download {spec} failed: {python_error_line(r.stderr or r.stdout)}")
    found = sorted(sd.glob(pattern))
    if not found:
        raise SystemExit(f"pip download {spec} left no sdist in {sd}")
    return found[-1]


def get_tree(cache: Path, sdist: Path) -> tuple[str, Path]:
    version = sdist.name[len("llama_cpp_python-"):-len(".tar.gz")]
    root = cache / version
    tree = root / "src" / "vendor" / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").exists():
        return version, tree
    log(f"unpacking {sdist.name} into {root / 'src'} ...")
    tmp = Path(tempfile.mkdtemp(dir=cache))
    with tarfile.open(sdist) as tf:
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tf.extractall(tmp, **kw)
    (inner,) = [p for p in tmp.iterdir() if p.is_dir()]
    root.mkdir(parents=True, exist_ok=True)
    if (root / "src").exists():
        shutil.rmtree(root / "src")
    inner.rename(root / "src")
    shutil.rmtree(tmp, ignore_errors=True)
    return version, tree


def tree_commit(tree: Path) -> str | None:
    """The llama.cpp commit the sdist vendors (its git metadata travels in the sdist)."""
    head = tree.parents[1] / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    try:
        text = head.read_text().strip()
    except OSError:
        return None
    return text if re.fullmatch(r"[0-9a-f]{40}", text) else None


def build(tree: Path, build_dir: Path, jobs: int) -> dict:
    bins = {t: build_dir / "bin" / t for t in TARGETS}
    stamp = build_dir / "attnkit-build.json"
    if all(p.exists() for p in bins.values()) and stamp.exists():
        info = json.loads(stamp.read_text())
        info["reused"] = True
        return info
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    t0 = time.time()
    log(f"configuring llama.cpp in {build_dir} ...")
    r = _run(["cmake", "-S", str(tree), "-B", str(build_dir), *gen, *CMAKE_FLAGS])
    if r.returncode != 0:
        raise SystemExit(f"cmake configure failed: {first_error_line(r.stderr + r.stdout)}")
    t1 = time.time()
    log(f"building {', '.join(TARGETS)} with -j{jobs} (several minutes on 2 cores) ...")
    r = _run([*nice, "cmake", "--build", str(build_dir), "--target", *TARGETS, "-j", str(jobs)])
    if r.returncode != 0:
        raise SystemExit(f"cmake build failed: {first_error_line(r.stdout + r.stderr)}")
    t2 = time.time()
    info = {
        "cmake_flags": list(CMAKE_FLAGS),
        "configure_s": round(t1 - t0, 1),
        "build_s": round(t2 - t1, 1),
        "jobs": jobs,
        "load_after_build": os.getloadavg(),
        "binaries": {k: str(v) for k, v in bins.items()},
    }
    stamp.write_text(json.dumps(info, indent=1))
    info["reused"] = False
    return info


# --------------------------------------------------------------------------------------------------
# conversion (child process: the stock converter, with the pre-tokenizer hash registered at run time)


def _convert_child(tree: str, model_dir: str, outtype: str, outfile: str, pre: str) -> None:
    """Runs in a child interpreter. Imports the tree's own converter (and its gguf-py), wraps
    TextModel.get_vocab_base_pre so that a hash it does not know maps to `pre`, then calls the
    converter's main() with ordinary arguments."""
    sys.path.insert(0, tree)
    sys.path.insert(1, str(Path(tree) / "gguf-py"))
    import conversion.base as base  # the tree's module, unmodified on disk

    original = base.TextModel.get_vocab_base_pre
    consts = original.__code__.co_consts
    chktxt = next(c for c in consts if isinstance(c, str) and "\U0001F680" in c)
    known = {c for c in consts if isinstance(c, str) and re.fullmatch(r"[0-9a-f]{64}", c)}

    def get_vocab_base_pre(self, tokenizer):  # noqa: ANN001
        chkhsh = hashlib.sha256(str(tokenizer.encode(chktxt)).encode()).hexdigest()
        if chkhsh in known or not pre:
            return original(self, tokenizer)
        print(f"ATTNKIT: pre-tokenizer hash {chkhsh} is unknown to this convert_hf_to_gguf.py; "
              f"registered at run time as {pre!r} (no llama.cpp file edited)", file=sys.stderr, flush=True)
        return pre

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    import convert_hf_to_gguf as conv

    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", outtype, "--outfile", outfile]
    conv.main()


# what the tree's converter imports (gguf-py's own deps, and sentencepiece: LlamaModel.set_vocab imports it
# before it looks for a tokenizer.model, so a Llama source needs the module even for a BPE tokenizer)
CONVERTER_DEPS = {"numpy": "numpy", "yaml": "pyyaml", "tqdm": "tqdm", "requests": "requests",
                  "sentencepiece": "sentencepiece>=0.1.98,<0.3.0", "torch": "torch", "transformers": "transformers"}


def ensure_converter_deps(install: bool) -> list[str]:
    """Installs (with pip, into this interpreter's environment) the converter's missing modules.
    torch and transformers are never installed here: they are attnkit's own dependencies."""
    import importlib.util  # noqa: PLC0415

    missing = [spec for mod, spec in CONVERTER_DEPS.items() if importlib.util.find_spec(mod) is None]
    if not missing:
        return []
    if not install or any(m.split(">")[0] in ("torch", "transformers") for m in missing):
        raise SystemExit(f"convert_hf_to_gguf.py needs {missing}: pip install {' '.join(repr(m) for m in missing)}")
    log(f"installing the converter's missing dependencies into {sys.prefix}: {missing}")
    r = _run([sys.executable, "-m", "pip", "install", *missing])
    if r.returncode != 0:
        raise SystemExit(f"pip install {missing} failed: {python_error_line(r.stderr or r.stdout)}")
    return missing


def convert(tree: Path, model_dir: Path, outtype: str, outfile: Path, pre: str | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "gguf-py"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_convert",
           str(tree), str(model_dir), outtype, str(outfile), pre or ""]
    t0 = time.time()
    r = _run(["nice", "-n", "10", *cmd], env=env)
    res = {"seconds": round(time.time() - t0, 1)}
    registered = re.search(r"ATTNKIT: pre-tokenizer hash (\w+) .* as '([^']+)'", r.stderr)
    if registered:
        res["pre_tokenizer_registered"] = {"hash": registered.group(1), "as": registered.group(2)}
    if r.returncode != 0 or not outfile.exists():
        res["error"] = "convert_hf_to_gguf: " + python_error_line(r.stderr + r.stdout)
    return res


def gguf_summary(tree: Path, path: Path) -> dict:
    """The architecture keys and the tensor names (layer 0 and the non-layer ones) of a GGUF,
    read with the tree's gguf-py: what the loader will look for."""
    sys.path.insert(0, str(tree / "gguf-py"))
    try:
        import gguf  # noqa: PLC0415

        reader = gguf.GGUFReader(str(path))
        arch = None
        kv = {}
        for field in reader.fields.values():
            name = field.name
            if name.startswith("tokenizer.ggml.") and name not in (
                    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"):
                continue
            if name.startswith("GGUF.") or name.startswith("general.") and name != "general.architecture":
                continue
            try:
                val = field.contents()
            except Exception:  # noqa: BLE001
                continue
            if isinstance(val, list) and len(val) > 8:
                val = f"<{len(val)} values>"
            kv[name] = val
            if name == "general.architecture":
                arch = val
        tensors = [t.name for t in reader.tensors]
        layer0 = sorted({t.name for t in reader.tensors if t.name.startswith("blk.0.")})
        other = sorted({t.name for t in reader.tensors if not t.name.startswith("blk.")})
        types = sorted({t.tensor_type.name for t in reader.tensors})
        return {"architecture": arch, "kv": kv, "n_tensors": len(tensors), "layer0_tensors": layer0,
                "other_tensors": other, "tensor_types": types}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        sys.path.remove(str(tree / "gguf-py"))


# --------------------------------------------------------------------------------------------------
# text, tokens, perplexities


def llama_tokenize(binary: Path, gguf_path: Path, text_file: Path, no_bos: bool = False) -> tuple[list[int] | None, str]:
    # the same call llama-perplexity makes: add special (BOS if the vocab wants it), no special parsing
    r = _run([str(binary), "-m", str(gguf_path), "-f", str(text_file), "--ids", "--no-parse-special",
              "--no-escape", "--log-disable", *(["--no-bos"] if no_bos else [])])
    m = re.search(r"^\[[0-9, ]*\]$", r.stdout, re.M)
    if r.returncode != 0 or not m:
        return None, first_error_line(r.stderr + r.stdout)
    return json.loads(m.group(0)), ""


def hf_perplexity(model_dir: Path, tokens: list[int], n_ctx: int, bos: int | None) -> dict:
    """transformers' perplexity over llama-perplexity's windows, float32, CPU."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        return {"error": f"transformers load: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    model.eval()
    lo, hi = scored_positions(n_ctx)
    nll, count, per_chunk = 0.0, 0, []
    t0 = time.time()
    with torch.inference_mode():
        for start, end in perplexity_windows(len(tokens), n_ctx):
            ids = torch.tensor([window_tokens(tokens, start, end, bos)])
            logits = model(ids).logits[0].float()
            logp = torch.log_softmax(logits[lo:hi], dim=-1)
            # targets are the ORIGINAL tokens (BOS only replaces position 0, never a target)
            tgt = torch.tensor(tokens[start + lo + 1:start + hi + 1])
            chunk = -logp.gather(1, tgt[:, None]).double().sum().item()
            nll += chunk
            count += hi - lo
            per_chunk.append(math.exp(nll / count))
    return {"ppl": math.exp(nll / count) if count else None, "scored_tokens": count,
            "chunks": len(per_chunk), "running": per_chunk, "seconds": round(time.time() - t0, 1),
            "model_type": getattr(model.config, "model_type", None)}


def hf_token_ids(model_dir: Path, text: str) -> list[int] | None:
    from transformers import AutoTokenizer  # noqa: PLC0415

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception:  # noqa: BLE001
        return None
    return tok(text, add_special_tokens=False)["input_ids"]


def llama_perplexity(binary: Path, gguf_path: Path, text_file: Path, n_ctx: int, threads: int | None,
                     extra: list[str] | None = None) -> dict:
    # -lv 4 only makes llama.cpp print its context settings (flash attention, cache types); the
    # computation is llama-perplexity's default
    cmd = ["nice", "-n", "10", str(binary), "-m", str(gguf_path), "-f", str(text_file), "-c", str(n_ctx), "-lv", "4"]
    if threads:
        cmd += ["-t", str(threads)]
    cmd += extra or []
    t0 = time.time()
    r = _run(cmd)
    text = r.stdout + "\n" + r.stderr
    res: dict = {"seconds": round(time.time() - t0, 1), "settings": parse_context_settings(text)}
    ppl = parse_final_ppl(text)
    running = parse_chunk_ppls(text)
    if ppl is None and running and r.returncode == 0:
        ppl = running[-1]  # printed when the std-dev line is skipped (e.g. nan)
    if r.returncode != 0 or ppl is None:
        res["error"] = first_error_line(text) + (f" (exit {r.returncode})" if r.returncode else "")
    else:
        res["ppl"] = ppl
        if not math.isfinite(ppl):
            res["error"] = f"perplexity is {ppl}"
    return res


# --------------------------------------------------------------------------------------------------
# --probe: how far a deepseek2 GGUF gets once each known refusal is edited away (diagnostics only)

PROBE_STEPS = (
    ("dense: no expert_count / expert_used_count / expert_group_count / expert_group_used_count keys",
     {"drop_keys": ("expert_count", "expert_used_count", "expert_group_count", "expert_group_used_count")}),
    ("+ attention.q_lora_rank = 0", {"set_u32": {"attention.q_lora_rank": 0}}),
    ("+ no attention bias tensors", {"drop_tensor_suffix": (".bias",)}),
    ("+ RoPE rows of attn_q and attn_kv_a_mqa moved from the half-split to the adjacent-pair layout",
     {"permute_rope": True}),
)
PROBE_RUNS = (("default", []), ("-fa off", ["-fa", "off"]), ("-fa off, f32 cache", ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]))


def half_split_to_pairs(n: int) -> list[int]:
    """Row order that turns a half-split RoPE block (x_0..x_{n/2-1}, y_0..y_{n/2-1}) into adjacent
    pairs (x_0, y_0, x_1, y_1, ...): new[2j] = old[j], new[2j+1] = old[j + n/2]."""
    h = n // 2
    return [j // 2 + (j % 2) * h for j in range(n)]


def edit_gguf(tree: Path, src: Path, dst: Path, drop_keys=(), set_u32=None, drop_tensor_suffix=(),
              permute_rope=False) -> list[str]:
    """Writes a copy of src with architecture keys dropped or set and tensors dropped, using the tree's
    gguf-py; returns what was changed. The GGUF is edited, never llama.cpp."""
    sys.path.insert(0, str(tree / "gguf-py"))
    try:
        import gguf  # noqa: PLC0415

        reader = gguf.GGUFReader(str(src))
        arch = reader.fields["general.architecture"].contents()
        writer = gguf.GGUFWriter(str(dst), arch)
        changed = []
        drop = {f"{arch}.{k}" for k in drop_keys}
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue  # the writer adds the architecture itself
            if field.name in drop:
                changed.append(f"dropped key {field.name}")
                continue
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
        for key, val in (set_u32 or {}).items():
            writer.add_uint32(f"{arch}.{key}", val)
            changed.append(f"set {arch}.{key} = {val}")
        kept = []
        rope_rows = {}
        if permute_rope:
            import numpy as np  # noqa: PLC0415

            kv = {f.name: f.contents() for f in reader.fields.values() if f.name.startswith(arch + ".")}
            d_r = int(kv[f"{arch}.rope.dimension_count"])
            d_k = int(kv[f"{arch}.attention.key_length_mla"])
            n_head = int(kv[f"{arch}.attention.head_count"])
            r = int(kv[f"{arch}.attention.kv_lora_rank"])
            perm = half_split_to_pairs(d_r)
            q_rows = np.arange(n_head * d_k)
            for h in range(n_head):
                base = h * d_k + d_k - d_r
                q_rows[base:base + d_r] = base + np.array(perm)
            kv_rows = np.arange(r + d_r)
            kv_rows[r:] = r + np.array(perm)
            rope_rows = {"attn_q.weight": q_rows, "attn_kv_a_mqa.weight": kv_rows}
        for t in reader.tensors:
            if drop_tensor_suffix and t.name.endswith(tuple(drop_tensor_suffix)) and ".attn_" in t.name:
                changed.append(f"dropped tensor {t.name}")
                continue
            data = t.data
            key = next((k for k in rope_rows if t.name.endswith(k)), None)
            if key is not None:
                if data.dtype.kind != "f" or data.shape[0] != len(rope_rows[key]):
                    raise ValueError(f"cannot permute {t.name} ({data.dtype}, {data.shape})")
                data = data[rope_rows[key]]
                changed.append(f"permuted RoPE rows of {t.name}")
            writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, t.tensor_type)
            kept.append(data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for data in kept:
            writer.write_tensor_data(data)
        writer.close()
        return changed
    finally:
        sys.path.remove(str(tree / "gguf-py"))


def probe(tree: Path, binary: Path, gguf_path: Path, text_file: Path, n_ctx: int, threads: int | None,
          hf_ppl: float | None, rope_interleaved: bool) -> list[dict]:
    out = []
    cur = gguf_path
    steps = [s for s in PROBE_STEPS if not (s[1].get("permute_rope") and rope_interleaved)]
    for i, (label, edit) in enumerate(steps):
        nxt = gguf_path.with_name(f"{gguf_path.stem}-probe{i + 1}.gguf")
        try:
            changed = edit_gguf(tree, cur, nxt, **edit)
        except Exception as e:  # noqa: BLE001
            out.append({"step": label, "error": f"GGUF edit: {type(e).__name__}: {e}"})
            break
        cur = nxt
        step = {"step": label, "changed": changed, "runs": {}}
        runs = PROBE_RUNS if i >= len(steps) - 2 else PROBE_RUNS[:1]
        for name, extra in runs:
            res = llama_perplexity(binary, cur, text_file, n_ctx, threads, extra)
            res["ratio"] = ratio(res.get("ppl"), hf_ppl)
            step["runs"][name] = {k: res[k] for k in ("ppl", "ratio", "error", "settings") if k in res}
        out.append(step)
    return out


# --------------------------------------------------------------------------------------------------


def run_model(model_dir: Path, args, tree: Path, bins: dict, text: str, workdir: Path) -> dict:
    out: dict = {"model": str(model_dir)}
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
        out["model_type"] = cfg.get("model_type")
    except (OSError, ValueError) as e:
        out["error"] = f"no readable config.json: {e}"
        return out
    pre = args.pre_tokenizer
    if pre is None:
        try:
            pre = byte_level_pre_tokenizer(json.loads((model_dir / "tokenizer.json").read_text()))
        except (OSError, ValueError):
            pre = None
    out["pre_tokenizer"] = pre
    text_file = workdir / "heldout.txt"
    text_file.write_text(text)
    hf_ids = hf_token_ids(model_dir, text)
    tokens, bos, hf = None, None, None
    out["types"] = {}
    for typ in args.types:
        tres: dict = {}
        out["types"][typ] = tres
        gguf_path = workdir / f"{model_dir.name}-{typ}.gguf"
        log(f"[{model_dir.name}] converting to {typ} ...")
        conv = convert(tree, model_dir, typ, gguf_path, pre)
        tres["convert"] = conv
        if "pre_tokenizer_registered" in conv:
            out["pre_tokenizer_registered"] = conv["pre_tokenizer_registered"]
        if "error" in conv:
            tres["error"] = conv["error"]
            continue
        tres["gguf_bytes"] = gguf_path.stat().st_size
        if args.gguf_summary and typ == args.types[0]:
            out["gguf"] = gguf_summary(tree, gguf_path)
        if tokens is None:
            ids, err = llama_tokenize(bins["llama-tokenize"], gguf_path, text_file)
            if ids is None:
                tres["error"] = f"llama-tokenize: {err}"
                continue
            tokens = ids
            # does this vocabulary add BOS (llama-perplexity then puts BOS first in every chunk)? ask
            # llama.cpp: the same text with --no-bos is one token shorter exactly when it does
            ids_nobos, err = llama_tokenize(bins["llama-tokenize"], gguf_path, text_file, no_bos=True)
            if ids_nobos is None:
                tres["error"] = f"llama-tokenize --no-bos: {err}"
                tokens = None
                continue
            add_bos = len(ids) == len(ids_nobos) + 1
            bos = ids[0] if add_bos else None
            body = ids[1:] if add_bos else ids
            out["tokens"] = {"llama_cpp": len(ids), "hf": None if hf_ids is None else len(hf_ids),
                             "llama_cpp_adds_bos": add_bos,
                             "identical_to_hf": hf_ids is not None and body == hf_ids}
            if hf_ids is not None and body != hf_ids:
                first_diff = next((i for i, (a, b) in enumerate(zip(body, hf_ids)) if a != b),
                                  min(len(body), len(hf_ids)))
                out["tokens"]["first_difference"] = first_diff
            log(f"[{model_dir.name}] transformers perplexity on llama.cpp's {len(ids)} tokens ...")
            hf = hf_perplexity(model_dir, tokens, args.ctx, bos)
            out["transformers"] = hf
        log(f"[{model_dir.name}] llama-perplexity {typ} ...")
        lp = llama_perplexity(bins["llama-perplexity"], gguf_path, text_file, args.ctx, args.threads)
        tres.update(lp)
        tres["ratio"] = ratio(lp.get("ppl"), (hf or {}).get("ppl"))
        if args.probe and "error" in lp and cfg.get("model_type") in ("deepseek_v2", "deepseek_v3") \
                and typ == args.types[0]:
            log(f"[{model_dir.name}] --probe: editing the {typ} GGUF past each known refusal ...")
            out["probe"] = probe(tree, bins["llama-perplexity"], gguf_path, text_file, args.ctx, args.threads,
                                 (hf or {}).get("ppl"), bool(cfg.get("rope_interleave", True)))
        if not args.keep_gguf:
            gguf_path.unlink(missing_ok=True)
            for edited in workdir.glob(f"{gguf_path.stem}-probe*.gguf"):
                edited.unlink()
    return out


def table(results: list[dict], types: list[str]) -> str:
    header = ["model", "tokens (llama.cpp = HF?)", "transformers ppl"] + [f"llama.cpp {t} ppl (ratio)" for t in types]
    rows = []
    for r in results:
        tok = r.get("tokens") or {}
        tokcell = f"{tok.get('llama_cpp', '-')} ({'yes' if tok.get('identical_to_hf') else 'NO'})" if tok else "-"
        hf = r.get("transformers") or {}
        hfcell = fmt(hf.get("ppl")) if "ppl" in hf else hf.get("error", "-")
        cells = []
        for t in types:
            tr = (r.get("types") or {}).get(t, {})
            if "error" in tr:
                cells.append(f"FAIL: {tr['error']}")
            else:
                cells.append(f"{fmt(tr.get('ppl'))} ({fmt(tr.get('ratio'), '.5f')})")
        name = r["model"] if "error" not in r else f"{r['model']} ({r['error']})"
        rows.append([name, tokcell, hfcell, *cells])
    return _common.markdown_table(header, rows)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--_convert":
        _convert_child(*argv[1:6])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", type=Path, help="Hugging Face checkpoint folders")
    ap.add_argument("--types", default="f32,f16,q8_0", help="GGUF types: f32,f16,bf16,q8_0")
    ap.add_argument("--ctx", type=int, default=512, help="llama-perplexity -c (window length)")
    ap.add_argument("--data", default="ppl",
                    help="held-out text: 'ppl' (bundled eval task data, default), 'validation' (attnkit.data), or a file")
    ap.add_argument("--out", type=Path, help="write the results JSON here")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--version", default=None, help="llama-cpp-python version (default: newest on PyPI, or the cached one)")
    ap.add_argument("--jobs", type=int, default=2, help="build parallelism")
    ap.add_argument("--threads", type=int, default=None, help="llama-perplexity -t (default: llama.cpp's)")
    ap.add_argument("--pre-tokenizer", default=None,
                    help="llama.cpp pre-tokenizer name to register for an unknown hash (default: from tokenizer.json)")
    ap.add_argument("--keep-gguf", type=Path, default=None, help="keep the GGUF files in this folder")
    ap.add_argument("--gguf-summary", action="store_true", help="record the GGUF's keys and layer-0 tensor names")
    ap.add_argument("--probe", action="store_true",
                    help="diagnostics: when a deepseek2 GGUF fails, edit copies of it (not llama.cpp) past each known "
                         "refusal and report what happens next")
    ap.add_argument("--build-only", action="store_true", help="fetch and build llama.cpp, then stop")
    ap.add_argument("--no-install", action="store_true",
                    help="do not pip-install the converter's missing Python modules (fail instead)")
    args = ap.parse_args(argv)
    args.types = [t.strip() for t in args.types.split(",") if t.strip()]
    bad = [t for t in args.types if t not in TYPES]
    if bad:
        ap.error(f"unknown GGUF type(s) {bad}; choose from {TYPES}")
    if not args.models and not args.build_only:
        ap.error("give at least one MODEL_DIR (or --build-only)")
    for m in args.models:
        if not (m / "config.json").exists():
            ap.error(f"{m} is not a Hugging Face checkpoint folder (no config.json)")

    sdist = get_sdist(args.cache, args.version)
    version, tree = get_tree(args.cache, sdist)
    build_info = build(tree, args.cache / version / "build", args.jobs)
    bins = {k: Path(v) for k, v in build_info["binaries"].items()}
    meta = {
        "llama_cpp_python": version,
        "llama_cpp_commit": tree_commit(tree),
        "tree": str(tree),
        "build": build_info,
        "pre_tokenizer_note": ("unknown pre-tokenizer hashes are registered at run time by wrapping "
                               "conversion.base.TextModel.get_vocab_base_pre in the converter's process; "
                               "no llama.cpp file is edited"),
    }
    log(f"llama.cpp from llama-cpp-python {version} (commit {meta['llama_cpp_commit']}), "
        f"build {'reused' if build_info['reused'] else 'done'} in {build_info['build_s']} s")
    if args.build_only:
        print(json.dumps(meta, indent=1))
        return 0

    meta["installed_converter_deps"] = ensure_converter_deps(not args.no_install)
    text, desc = load_text(args.data)
    meta.update({"data": desc, "ctx": args.ctx, "types": args.types,
                 "windowing": (f"llama-perplexity default: whole {args.ctx}-token chunks from the start, "
                               f"BOS replaces the first token of each chunk when the vocab adds BOS, "
                               f"targets at positions {args.ctx // 2 + 1}..{args.ctx - 1} of each chunk; "
                               f"transformers is scored on the same ids and positions"),
                 "load_at_start": os.getloadavg()})
    results = []
    keep = args.keep_gguf
    for m in args.models:
        with tempfile.TemporaryDirectory(prefix="attnkit-llama-") as td:
            work = Path(td)
            if keep:
                keep.mkdir(parents=True, exist_ok=True)
                work = keep
            results.append(run_model(m.resolve(), args, tree, bins, text, work))
    meta["load_at_end"] = os.getloadavg()
    report = {"meta": meta, "results": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    print(table(results, args.types))
    return 0


if __name__ == "__main__":
    sys.exit(main())
