"""Drivers for `attnkit convert --to dex | diff | mla+dex`.

Load the source in fp32, run calibration text through it once (attention entropy per head, RMS of
each head's output), rewrite the model in place (new config class + DEX/DIFF modules, source
weights untouched), check that the logits did not move, and save OUT atomically with the
modeling code (`auto_map`), the tokenizer, `attnkit_report.json` and a model card.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import tempfile
from pathlib import Path

import torch
from tqdm.auto import tqdm

from attnkit import __version__
from attnkit.converters import dex as dex_math
from attnkit.converters import diff as diff_math
from attnkit.data import pack_tokens
from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import INDEX_FILE, SINGLE_FILE, atomic_output_dir, check_output_dir
from attnkit.io.resolve import check_causal_lm, resolve_model

ANNEAL_FRACTION = 0.25  # λ (and DIFF's norm) ramp in over the first quarter of the fine-tune
_EVAL_ROWS = 4
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def convert_dex(args: argparse.Namespace) -> int:
    return _convert(args, "dex")


def convert_diff(args: argparse.Namespace) -> int:
    return _convert(args, "diff")


def convert_mla_dex(args: argparse.Namespace) -> int:
    """MLA first (the MLA pipeline, into a scratch folder), then DEX on its DeepSeek-V3 output."""
    dex_math.parse_heads(args.heads, args.heads_fraction)  # refuse bad input before the long MLA step
    check_output_dir(args.out, args.force)
    try:
        from attnkit.io.mla_pipeline import convert as convert_mla
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("attnkit"):
            raise AttnkitError("`--to mla+dex` needs the MLA pipeline, which is not available in this version") from None
        raise
    out = Path(args.out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.mla-", dir=out.parent) as scratch:
        mla_out = Path(scratch) / "mla"
        mla_args = copy.copy(args)
        mla_args.to, mla_args.out, mla_args.force = "mla", str(mla_out), False
        convert_mla(mla_args)
        prior = json.loads((mla_out / "attnkit_report.json").read_text())
        return _convert(args, "mla+dex", source_path=mla_out, prior=prior)


# ---------------------------------------------------------------- the shared driver


def _convert(args: argparse.Namespace, method: str, source_path: Path | None = None, prior: dict | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnkit.adapters.modeling_attnkit import CLASSES, FAMILIES, install_retrofit

    rule, fraction = dex_math.parse_heads(args.heads, args.heads_fraction) if method != "diff" else ("", 0.0)
    check_output_dir(args.out, args.force)
    path = source_path or resolve_model(args.model)
    config = check_causal_lm(path)
    model_type = config.get("model_type", "")
    if model_type.startswith("attnkit_"):
        raise AttnkitError(f"{args.model} is already an attnkit {config.get('attnkit', {}).get('method')} model; convert its source")
    if model_type not in FAMILIES:
        raise AttnkitError(
            f"attention of model_type {model_type!r} is not recognised for {method.upper()} "
            f"(supported: {', '.join(sorted(FAMILIES))})"
        )
    device = _device(args.device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises OSError/ValueError/… for a missing tokenizer
        raise AttnkitError(f"cannot load the tokenizer of {args.model} (needed for calibration): {str(exc).splitlines()[0]}") from None
    calib = pack_tokens(tokenizer, args.calib, "train", args.calib_seq_len, args.calib_tokens, args.seed)
    evaluation, eval_split = _eval_rows(tokenizer, args, calib)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").to(device).eval()
    source_dtype = _source_dtype(config)
    stats = calibrate(model, calib, device)
    kv_before = _kv_bytes(model)
    logits_before = _logits(model, evaluation, device)

    # rewrite in place: same parameters, new config class + modules
    family = FAMILIES[model_type]
    config_class, model_class = CLASSES[model_type]
    heads = family.head_dims(model.config)[0]
    extras: dict = {}
    if method == "diff":
        fields = diff_math.diff_config_fields(ANNEAL_FRACTION, model_type, model.config.num_hidden_layers)
    else:
        selected = dex_math.select_heads(stats["entropy"], rule, fraction)
        fields = dex_math.dex_config_fields(selected, ANNEAL_FRACTION, model_type, method)
        extras["heads"] = {
            "rule": rule,
            "fraction": fraction,
            "score": "normalised attention entropy on calibration text (higher = more diffuse); top ceil(fraction*H) per layer",
            "scores": [[round(float(s), 6) for s in row] for row in stats["entropy"]],
            "selected": selected,
            "num_heads": heads,
        }
    model.config.__class__ = config_class
    model.config.attnkit = fields
    model.__class__ = model_class
    install_retrofit(model, model.config, model_type)
    if method == "diff":
        for attn in (m for m in model.modules() if hasattr(m, "diff")):
            head_dim = attn.diff.norm_weight.shape[1]
            attn.diff.norm_weight.data.copy_(diff_math.norm_weights(stats["head_rms"][attn.layer_idx], attn.layer_idx, head_dim))
        extras["diff"] = {
            "head_output_rms": [[round(float(s), 6) for s in row] for row in stats["head_rms"]],
            "departures": "second map = new zero-initialised query on the shared keys (no cache change); "
            "heads not paired; lambda and per-head RMSNorm ramped in from 0 by the fine-tune schedule",
        }
    model.to(device).eval()
    kv_after = _kv_bytes(model)
    logits_after = _logits(model, evaluation, device)
    step = {"name": f"insert {method} modules (ramp 0)", **_compare(logits_before, logits_after, evaluation)}
    step["exact"] = step["logits_rel_err_max"] == 0.0
    ppl_before = step.pop("ppl_before")

    out_dtype = _DTYPES[args.dtype] if args.dtype else source_dtype
    report = {
        "attnkit_version": __version__,
        "method": method,
        "source": _source_info(args.model, path, model_type),
        "settings": _settings(args),
        "kv_cache_bytes_per_token": {"before": kv_before, "after": kv_after},
        "kv_cache_effect": "unchanged: Q, K, V and the cache are the source's",
        "steps": [*(prior or {}).get("steps", []), step],
        "ppl": {"before": ppl_before, "after": step["ppl"], "split": eval_split},
        "load": {**(prior or {}).get("load", {}), "trust_remote_code": True},
        "calibration": {"rows": int(calib.shape[0]), "seq_len": int(calib.shape[1]), "source": args.calib},
        "anneal_fraction": ANNEAL_FRACTION,
        "lambda_init": fields["lambda_init"],
        "output_dtype": str(out_dtype).replace("torch.", ""),
        **extras,
    }
    if prior is not None:
        report["source"] = {**prior.get("source", {}), "model": args.model}
        report["kv_cache_bytes_per_token"]["before"] = prior.get("kv_cache_bytes_per_token", {}).get("before", kv_before)
        report["mla"] = {k: v for k, v in prior.items() if k not in ("steps", "source", "settings", "load")}
    with atomic_output_dir(args.out, args.force) as tmp:
        model.to("cpu", out_dtype).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "attnkit_report.json").write_text(json.dumps(report, indent=2))
        _write_card(tmp)
    print(_summary(report, args.out))
    return 0


# ---------------------------------------------------------------- calibration and measurement


@torch.no_grad()
def calibrate(model, rows: torch.Tensor, device: torch.device) -> dict:
    """Per layer and head: mean normalised attention entropy and mean RMS of the head output."""
    layers = model.config.num_hidden_layers
    attns = [m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")]
    ent_sum: list = [0.0] * layers
    rms_sum: list = [0.0] * layers
    counts = {"ent": [0] * layers, "rms": [0] * layers}
    hooks = []

    def on_attention(module, _inputs, output):
        weights = output[1]
        if weights is None:
            raise AttnkitError("calibration needs attention weights; the model did not return them")
        s, n = dex_math.normalized_entropy(weights)
        ent_sum[module.layer_idx] = ent_sum[module.layer_idx] + s
        counts["ent"][module.layer_idx] += n

    def on_o_proj(layer_idx, heads):
        def hook(_module, inputs):
            x = inputs[0]
            s, n = diff_math.head_rms(x.view(*x.shape[:-1], heads, -1))  # [B, T, H·d_v] -> [B, T, H, d_v]
            rms_sum[layer_idx] = rms_sum[layer_idx] + s
            counts["rms"][layer_idx] += n

        return hook

    heads = model.config.num_attention_heads
    for attn in attns:
        hooks.append(attn.register_forward_hook(on_attention))
        hooks.append(attn.o_proj.register_forward_pre_hook(on_o_proj(attn.layer_idx, heads)))
    try:
        for batch in tqdm(_batches(rows), desc="calibration", unit="batch", leave=False):
            model(input_ids=batch.to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    if any(c == 0 for c in counts["ent"]):
        raise AttnkitError("calibration saw no attention in some layer (sequence length must be at least 2)")
    entropy = torch.stack([ent_sum[i] / counts["ent"][i] for i in range(layers)]).float()  # [L, H]
    head_rms = torch.stack([rms_sum[i] / counts["rms"][i] for i in range(layers)]).float()  # [L, H]
    return {"entropy": entropy, "head_rms": head_rms}


def _eval_rows(tokenizer, args, calib: torch.Tensor) -> tuple[torch.Tensor, str]:
    """A few held-out rows for the before/after comparison (calibration rows if none are held out)."""
    try:
        rows = pack_tokens(tokenizer, args.calib, "validation", args.calib_seq_len, _EVAL_ROWS * args.calib_seq_len, args.seed)
        return rows[:_EVAL_ROWS], "validation"
    except AttnkitError:
        return calib[:_EVAL_ROWS], "train"


@torch.no_grad()
def _logits(model, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.cat([model(input_ids=b.to(device), use_cache=False).logits.float().cpu() for b in _batches(rows)])


def _batches(rows: torch.Tensor, tokens_per_batch: int = 4096) -> list[torch.Tensor]:
    """Split [N, T] rows into batches of about `tokens_per_batch` tokens."""
    size = max(1, tokens_per_batch // rows.shape[1])
    return list(rows.split(size))


def _compare(before: torch.Tensor, after: torch.Tensor, ids: torch.Tensor) -> dict:
    """Relative logits error per token, KL(source ‖ converted), perplexities; logits [N, T, V]."""
    rel = (after - before).norm(dim=-1) / before.norm(dim=-1).clamp_min(1e-12)  # [N, T]
    logp, logq = before.log_softmax(-1), after.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    return {
        "logits_rel_err_mean": float(rel.mean()),
        "logits_rel_err_max": float(rel.max()),
        "kl": float(kl),
        "ppl_before": _ppl(before, ids),
        "ppl": _ppl(after, ids),
    }


def _ppl(logits: torch.Tensor, ids: torch.Tensor) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return float(torch.exp(nll))


def _kv_bytes(model) -> int:
    from attnkit.evaluation.kv import kv_cache_bytes_per_token

    return int(kv_cache_bytes_per_token(model)["total"])


# ---------------------------------------------------------------- small helpers


def _device(name: str | None) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise AttnkitError("--device cuda was given but no CUDA device is available")
    return torch.device(name or "cpu")


def _source_dtype(config: dict) -> torch.dtype:
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").replace("torch.", "")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def _sha256(path: Path, limit: int | None = None) -> str | None:
    if not path.is_file():
        return None
    with path.open("rb") as f:
        return hashlib.sha256(f.read(limit) if limit else f.read()).hexdigest()


def _weights_header_hash(path: Path) -> str | None:
    """sha256 of the index file, or of a single file's safetensors header (names, shapes, offsets)."""
    if (path / INDEX_FILE).is_file():
        return _sha256(path / INDEX_FILE)
    single = path / SINGLE_FILE
    if not single.is_file():
        return None
    with single.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
    return _sha256(single, 8 + size)


def _source_info(model_arg: str, path: Path, model_type: str) -> dict:
    return {
        "model": model_arg,
        "path": str(path),
        "model_type": model_type,
        "sha256_config": _sha256(path / "config.json"),
        "sha256_weights_index": _weights_header_hash(path),
    }


def _settings(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None))) and k != "command"}


def _write_card(folder: Path) -> None:
    try:
        from attnkit.io.model_card import write_model_card
    except ModuleNotFoundError as exc:  # the publish engineer's module; optional until it lands
        if exc.name and exc.name.startswith("attnkit"):
            return
        raise
    write_model_card(folder)


def _summary(report: dict, out: str) -> str:
    step = report["steps"][-1]
    lines = [
        f"attnkit convert --to {report['method']}: wrote {out}",
        f"  logits rel. error max {step['logits_rel_err_max']:.2e} (exact: {step['exact']}), "
        f"ppl {report['ppl']['before']:.3f} -> {report['ppl']['after']:.3f} ({report['ppl']['split']})",
        f"  KV cache bytes/token {report['kv_cache_bytes_per_token']['before']} -> {report['kv_cache_bytes_per_token']['after']}",
    ]
    if "heads" in report:
        sel = report["heads"]["selected"]
        lines.append(f"  DEX heads per layer: {[len(s) for s in sel]} of {report['heads']['num_heads']} ({report['heads']['rule']})")
    return "\n".join(lines)
