"""Does a DeepSeek-V3 checkpoint give the same logits in older transformers as in 5.x?

    python benchmarks/compat_transformers.py MODEL_DIR [--versions 4.53.3,current] [--out compat.json]
        [--apply-legacy-fields] [--tol 1e-4] [--attn eager] [--cache-dir DIR] [--torch 2.13.0]
        [--reference-model DIR] [--make-synthetic ROPE[,interleave][,bias][,qlora]]

Each version other than `current` gets its own cached virtual environment under --cache-dir
(default ~/.cache/attnkit/compat): `transformers==V safetensors tokenizers`, with torch taken from
one shared environment (`torch==--torch numpy`, pinned: an unpinned torch pulls a CUDA build).
`current` (alias `5.x` when it is 5.x) is the interpreter running this script.

In each version a subprocess loads MODEL_DIR with AutoTokenizer + AutoModelForCausalLM (fp32),
tokenises a fixed text, and computes the logits of the reference version's token ids (so a
tokenizer difference and a model difference are reported apart). The reference is the newest
version listed. Per version the table shows: whether the tokenizer loaded and gives the same ids,
the RoPE inverse frequencies and softmax scale it built (against the reference's), max and mean
relative logit error (per position ||l - l_ref|| / ||l_ref||), argmax agreement, and the load
warnings (missing / unexpected weights). A version that fails gets a one-line reason. Exit status
1 when any version fails or is above --tol.

--apply-legacy-fields runs on a copy of MODEL_DIR (weights linked, not copied) whose config.json and
tokenizer_config.json get `legacy_fields()` / `legacy_tokenizer_fields()`: the keys transformers
4.x needs to build the same model as 5.x (see docs/compat.md). Those two functions are pure and are
meant for the converter, with `min_transformers()` for the model card.
--reference-model: the reference version runs on that checkpoint instead (e.g. the unedited original
of a hand-edited MODEL_DIR); --make-synthetic first writes a small random DeepSeek-V3 into MODEL_DIR.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# --------------------------------------------------------------------------------------------
# What transformers 4.x needs (pure; measured in docs/compat.md)
# --------------------------------------------------------------------------------------------

# A tokenizer class that transformers 4.x and 5.x both resolve. transformers 5 writes
# `TokenizersBackend`, which 4.x does not have; `PreTrainedTokenizerFast` (tokenizer.json) exists in
# both and 5.x maps it to the same tokenizers-backed class.
# what the converter writes for transformers 4.x (moved into the package; measured with this script)
from attnkit.converters.mla.legacy import legacy_fields, legacy_tokenizer_fields, version_key  # noqa: E402


def apply_legacy_fields(src: Path, dst: Path) -> dict:
    """A copy of checkpoint `src` in `dst` (large files symlinked) with the legacy fields written.
    Returns {"config": {...}, "tokenizer_config": {...}}: what was changed."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.name in ("config.json", "tokenizer_config.json") or p.is_dir():
            continue
        target = dst / p.name
        if target.exists() or target.is_symlink():
            target.unlink()
        target.symlink_to(p.resolve())
    changed = {}
    cfg = json.loads((src / "config.json").read_text())
    changed["config"] = legacy_fields(cfg)
    (dst / "config.json").write_text(json.dumps({**cfg, **changed["config"]}, indent=2) + "\n")
    tc_path = src / "tokenizer_config.json"
    if tc_path.exists():
        tc = json.loads(tc_path.read_text())
        changed["tokenizer_config"] = legacy_tokenizer_fields(tc)
        (dst / "tokenizer_config.json").write_text(json.dumps({**tc, **changed["tokenizer_config"]}, indent=2) + "\n")
    return changed


# --------------------------------------------------------------------------------------------
# Small random DeepSeek-V3 checkpoints, one per RoPE mode (made with this interpreter's transformers 5)
# --------------------------------------------------------------------------------------------

SYNTHETIC_ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    # 8 arbitrary per-slot factors: attnkit's `exact` mode
    "longrope": {"rope_type": "longrope", "factor": 1.0, "rope_theta": 10000.0,
                 "original_max_position_embeddings": 16384, "attention_factor": 1.0},
    # factor = max_position_embeddings / original_max_position_embeddings (16384 / 4096)
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096,
             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    # factor 2 != 16384 / 4096: transformers < 4.56 uses 4
    "yarn-f2": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}


def make_synthetic(out: Path, spec: str, tokenizer_from: Path) -> None:
    """A 2-layer random DeepSeek-V3 (dense, tied embeddings, d_r = 16) written by transformers 5.
    spec: ROPE[,interleave][,bias][,qlora] with ROPE a key of SYNTHETIC_ROPE."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    rope, *flags = spec.split(",")
    bad = set(flags) - {"interleave", "bias", "qlora"}
    if rope not in SYNTHETIC_ROPE or bad:
        raise SystemExit(f"--make-synthetic {spec!r}: ROPE in {sorted(SYNTHETIC_ROPE)}, flags interleave,bias,qlora")
    d_r, layers = 16, 2
    rp = dict(SYNTHETIC_ROPE[rope])
    if rope == "longrope":
        g = torch.Generator().manual_seed(1)
        rp["long_factor"] = rp["short_factor"] = (torch.rand(d_r // 2, generator=g) * 3 + 0.5).tolist()
    cfg = DeepseekV3Config(
        vocab_size=json.loads((tokenizer_from / "config.json").read_text())["vocab_size"], hidden_size=256,
        intermediate_size=512, moe_intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=1, n_group=1, topk_group=1,
        num_experts_per_tok=1, first_k_dense_replace=layers, kv_lora_rank=48,
        q_lora_rank=96 if "qlora" in flags else None, qk_rope_head_dim=d_r, qk_nope_head_dim=32, v_head_dim=32,
        max_position_embeddings=16384, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters=rp,
        rope_interleave="interleave" in flags, attention_bias="bias" in flags, num_nextn_predict_layers=0,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, initializer_range=0.08,
        architectures=["DeepseekV3ForCausalLM"])
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # norms and biases away from their trivial init
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / f, out / f)


# --------------------------------------------------------------------------------------------
# Virtual environments
# --------------------------------------------------------------------------------------------

def _purelib(python: Path) -> str:
    return subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()


def _build_venv(path: Path, requirements: list[str], log: Path, extra_site: str | None = None) -> Path:
    """python3 -m venv `path` + pip install; cached: a finished one has `.attnkit-ok`."""
    python = path / "bin" / "python"
    if (path / ".attnkit-ok").exists():
        return python
    if path.exists():
        shutil.rmtree(path)
    print(f"building {path.name}: pip install {' '.join(requirements)} (log: {log})", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    if extra_site:  # share one torch between the environments: its site-packages goes after ours
        Path(_purelib(python), "_attnkit_shared_torch.pth").write_text(extra_site + "\n")
    with open(log, "w") as fh:
        r = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", *requirements],
                           stdout=fh, stderr=subprocess.STDOUT)
    if r.returncode:
        raise RuntimeError(f"pip install {' '.join(requirements)} failed (see {log})")
    (path / ".attnkit-ok").write_text(" ".join(requirements) + "\n")
    return python


def environment(version: str, cache: Path, torch_version: str) -> Path:
    """The python executable of a cached environment with transformers==version."""
    cache.mkdir(parents=True, exist_ok=True)
    base = _build_venv(cache / f"torch-{torch_version}", [f"torch=={torch_version}", "numpy"],
                       cache / f"torch-{torch_version}.log")
    return _build_venv(cache / f"transformers-{version}", [f"transformers=={version}", "safetensors", "tokenizers"],
                       cache / f"transformers-{version}.log", extra_site=_purelib(base))


# --------------------------------------------------------------------------------------------
# The worker: runs inside each environment, imports nothing from attnkit
# --------------------------------------------------------------------------------------------

TEXT = '''def merge_sorted(left, right):
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i]); i += 1
        else:
            out.append(right[j]); j += 1
    return out + left[i:] + right[j:]


class Counter(dict):
    def add(self, key, n=1):
        self[key] = self.get(key, 0) + n
'''

WORKER = r'''
import json, logging, sys, traceback
from pathlib import Path

model_dir, out_dir, text_file, ref_ids_file, attn = sys.argv[1:6]
out = Path(out_dir)
res = {"python": sys.executable}

def one_line(e):
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]

class Grab(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []
    def emit(self, record):
        line = record.getMessage().strip().splitlines()
        if line and line[0] not in self.lines:
            self.lines.append(line[0][:300])

try:
    import numpy as np, torch, transformers, tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    res.update(transformers=transformers.__version__, torch=torch.__version__, tokenizers=tokenizers.__version__)
    grab = Grab()
    logging.getLogger("transformers").addHandler(grab)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    text = Path(text_file).read_text()
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        res["tokenizer_class"] = type(tok).__name__
        ids = tok(text)["input_ids"]
        np.save(out / "ids.npy", np.asarray(ids, dtype=np.int64))
    except Exception as e:
        res["tokenizer_error"] = one_line(e)
        ids = None
    if ref_ids_file != "-":
        ids = np.load(ref_ids_file).tolist()
    if ids is None:
        raise RuntimeError("no token ids (tokenizer failed and no reference ids)")
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kw = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32, "output_loading_info": True}
    if attn != "default":
        kw["attn_implementation"] = attn
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
    model.eval()
    res["model_class"] = type(model).__name__
    res["loading_info"] = {k: sorted(map(str, v))[:20] for k, v in info.items() if v}
    rot = getattr(model.model, "rotary_emb", None)
    if rot is not None:
        np.save(out / "inv_freq.npy", rot.inv_freq.detach().double().cpu().numpy())
        res["attention_scaling"] = float(getattr(rot, "attention_scaling", 1.0))
    attn0 = model.model.layers[0].self_attn
    res["softmax_scale"] = float(getattr(attn0, "scaling", float("nan")))
    res["tied"] = bool(model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr())
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()
    np.save(out / "logits.npy", logits)
    res["n_tokens"] = len(ids)
except Exception as e:
    res["error"] = one_line(e)
    res["traceback"] = traceback.format_exc()[-3000:]
finally:
    try:
        res["warnings"] = grab.lines[:20]
    except NameError:
        pass
    (out / "result.json").write_text(json.dumps(res, indent=2))
'''


def run_worker(python: Path, model_dir: Path, out: Path, text_file: Path, ref_ids: Path | None, attn: str,
               timeout: int) -> dict:
    if out.exists():  # never compare against a previous run's files
        shutil.rmtree(out)
    out.mkdir(parents=True)
    worker = out / "worker.py"
    worker.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="warning")
    cmd = [str(python), str(worker), str(model_dir), str(out), str(text_file), str(ref_ids or "-"), attn]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=out)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    path = out / "result.json"
    if not path.exists():
        tail = (r.stderr or r.stdout or "").strip().splitlines()
        return {"error": f"worker exited {r.returncode}: {tail[-1] if tail else 'no output'}"[:300]}
    return json.loads(path.read_text())


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------

def compare_logits(logits, ref) -> dict:
    """Per position relative L2 error ||l - ref|| / ||ref||: max and mean; argmax agreement."""
    import numpy as np

    a, b = np.asarray(logits, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if a.shape != b.shape:
        return {"shape": list(a.shape), "ref_shape": list(b.shape)}
    rel = np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1), 1e-30)
    return {"max_rel": float(rel.max()), "mean_rel": float(rel.mean()),
            "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).mean()),
            "max_abs": float(np.abs(a - b).max())}


def compare_inv_freq(inv, ref) -> float | None:
    import numpy as np

    if inv is None or ref is None or np.shape(inv) != np.shape(ref):
        return None
    return float(np.max(np.abs(np.asarray(inv) / np.asarray(ref) - 1.0)))


def summarise(row: dict, tol: float) -> str:
    """'ok' or a one-line reason."""
    if "error" in row:
        return row["error"]
    reasons = []
    if "tokenizer_error" in row:
        reasons.append(f"tokenizer: {row['tokenizer_error']}")
    elif row.get("ids_match") is False:
        reasons.append("token ids differ")
    li = row.get("loading_info", {})
    if li.get("missing_keys"):
        reasons.append(f"{len(li['missing_keys'])} missing weights (e.g. {li['missing_keys'][0]})")
    if li.get("unexpected_keys"):
        reasons.append(f"{len(li['unexpected_keys'])} unexpected weights (e.g. {li['unexpected_keys'][0]})")
    cmp_ = row.get("logits", {})
    if "max_rel" not in cmp_:
        reasons.append(f"logits shape {cmp_.get('shape')} vs {cmp_.get('ref_shape')}")
    elif not cmp_["max_rel"] <= tol:
        reasons.append(f"logits {cmp_['max_rel']:.3g} relative off")
    return "; ".join(reasons) or "ok"


def _fmt(x, spec=".2e"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(rows: list[dict]) -> str:
    head = ["transformers", "tokenizer", "ids", "inv_freq", "scale", "max rel", "mean rel", "argmax", "status"]
    lines = []
    for r in rows:
        lg = r.get("logits", {})
        lines.append([
            r.get("label") or r["version"],
            r.get("tokenizer_class", "FAILED" if "tokenizer_error" in r else "-"),
            {True: "same", False: "DIFF", None: "-"}[r.get("ids_match")],
            _fmt(r.get("inv_freq_rel")),
            _fmt(r.get("softmax_scale_rel")),
            _fmt(lg.get("max_rel")),
            _fmt(lg.get("mean_rel")),
            _fmt(lg.get("argmax_agree"), ".3f"),
            "reference" if r.get("reference") else r["status"],
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(str(x).ljust(w) for x, w in zip(line, widths)) + " |" for line in lines]
    return "\n".join(out)


def resolve_versions(spec: str) -> list[str]:
    """`current` / `5.x` -> 'current' (the running interpreter); anything else an exact release."""
    out = []
    for v in (x.strip() for x in spec.split(",") if x.strip()):
        if v in ("current", "5.x"):
            if v == "5.x":
                import transformers

                if not transformers.__version__.startswith("5."):
                    raise SystemExit(f"`5.x` means this interpreter's transformers: {transformers.__version__}")
            v = "current"
        out.append(v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--versions", default="4.53.3,current",
                    help="comma-separated transformers releases; `current` (or `5.x`) = this interpreter")
    ap.add_argument("--reference", default=None, help="version the others are compared with (default: newest)")
    ap.add_argument("--reference-model", type=Path, default=None,
                    help="checkpoint the reference version runs on (default MODEL_DIR as written); e.g. the "
                         "unedited original of a hand-edited MODEL_DIR")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--tol", type=float, default=1e-4, help="max relative logit error (default 1e-4)")
    ap.add_argument("--apply-legacy-fields", action="store_true",
                    help="run on a copy with legacy_fields()/legacy_tokenizer_fields() applied")
    ap.add_argument("--attn", default="eager", help="attn_implementation (eager, sdpa, or `default`)")
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get(
        "ATTNKIT_COMPAT_CACHE", Path.home() / ".cache" / "attnkit" / "compat")))
    ap.add_argument("--torch", default="2.13.0", help="torch release for the built environments (pinned)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per version")
    ap.add_argument("--work-dir", type=Path, default=None, help="keep the per-version outputs here")
    ap.add_argument("--make-synthetic", metavar="SPEC", default=None,
                    help="first write a small random DeepSeek-V3 into MODEL_DIR (must be absent): "
                         "ROPE[,interleave][,bias][,qlora], ROPE one of " + ", ".join(SYNTHETIC_ROPE))
    ap.add_argument("--tokenizer-from", type=Path,
                    default=Path(__file__).resolve().parents[1] / "attnkit" / "assets" / "reference",
                    help="tokenizer (and vocab size) of --make-synthetic (default: the bundled reference)")
    args = ap.parse_args(argv)

    import numpy as np

    if args.make_synthetic:
        if args.model_dir.exists():
            raise SystemExit(f"{args.model_dir} exists: --make-synthetic writes a new checkpoint")
        make_synthetic(args.model_dir, args.make_synthetic, args.tokenizer_from)
    model_dir = args.model_dir.resolve()
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"{model_dir}: no config.json")
    versions = resolve_versions(args.versions)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="attnkit-compat-"))
    work.mkdir(parents=True, exist_ok=True)
    changed = None
    if args.apply_legacy_fields:
        changed = apply_legacy_fields(model_dir, work / "model")
        model_dir = work / "model"
    text_file = work / "text.txt"
    text_file.write_text(TEXT)

    pythons: dict[str, Path | str] = {}
    for v in versions:
        try:
            pythons[v] = Path(sys.executable) if v == "current" else environment(v, args.cache_dir, args.torch)
        except Exception as e:  # noqa: BLE001 - reported in the table
            pythons[v] = f"environment: {e}"

    # the reference first: its token ids are the input of every other version
    def key(v: str) -> tuple:
        if v == "current":
            import transformers

            return version_key(transformers.__version__)
        return version_key(v)

    ref_v = args.reference or max(versions, key=key)
    # the reference first, on MODEL_DIR as written: its token ids are every other run's input;
    # with --apply-legacy-fields every version (the reference's too) then runs on the patched copy
    runs = [(ref_v, (args.reference_model or args.model_dir).resolve(), "")]
    tag = " +legacy" if changed is not None else " model_dir" if args.reference_model else ""
    runs += [(v, model_dir, tag) for v in versions if tag or v != ref_v]
    q_lora_none = json.loads((model_dir / "config.json").read_text()).get("q_lora_rank", 0) is None
    rows, ref = [], None
    for v, mdir, tag in runs:
        out = work / (v + tag.replace(" ", "-").replace("+", ""))
        py = pythons[v]
        print(f"running transformers {v}{tag} ...", file=sys.stderr, flush=True)
        row = {"version": v, "model": str(mdir) + tag}
        if isinstance(py, str):
            row["error"] = py
        else:
            ref_ids = ref["ids_file"] if ref is not None and ref["ids_file"].exists() else None
            t0 = time.time()
            row.update(run_worker(py, mdir, out, text_file, ref_ids, args.attn, args.timeout))
            row["seconds"] = round(time.time() - t0, 1)
        row["label"] = (row.get("transformers") or v) + tag
        logits = np.load(out / "logits.npy") if (out / "logits.npy").exists() else None
        inv = np.load(out / "inv_freq.npy") if (out / "inv_freq.npy").exists() else None
        ids = np.load(out / "ids.npy") if (out / "ids.npy").exists() else None
        if ref is None:
            if logits is None:
                row["status"] = f"reference failed: {row.get('error', 'no logits')}"
                rows.append(row)
                break
            row["reference"] = True
            row["status"] = "ok"
            ref = {"logits": logits, "inv": inv, "ids": ids, "scale": row.get("softmax_scale"),
                   "ids_file": out / "ids.npy"}
        else:
            if ids is not None and ref["ids"] is not None:
                row["ids_match"] = bool(ids.shape == ref["ids"].shape and (ids == ref["ids"]).all())
            if logits is not None:
                row["logits"] = compare_logits(logits, ref["logits"])
                row["inv_freq_rel"] = compare_inv_freq(inv, ref["inv"])
                if row.get("softmax_scale") and ref["scale"]:
                    row["softmax_scale_rel"] = abs(row["softmax_scale"] / ref["scale"] - 1.0)
            row["status"] = summarise(row, args.tol)
        if "error" in row and "NoneType" in row["error"] and q_lora_none:
            row["status"] += " (q_lora_rank: null needs transformers >= 4.53)"
        if row.get("status") == "ok":
            row.pop("traceback", None)
        rows.append(row)

    print(table(rows))
    bad = [r for r in rows if r.get("status") != "ok"]
    for r in rows:
        for w in r.get("warnings", [])[:5]:
            print(f"  [{r.get('label', r['version'])}] warning: {w}")
    result = {"model_dir": str(args.model_dir), "tol": args.tol, "attn": args.attn, "text": TEXT,
              "legacy_fields_applied": changed, "rows": rows,
              "ok": not bad and len(rows) == len(runs)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
