"""The in-place retrofit shared by `attnkit convert --to dex | diff | mla+dex` (their entry points:
`converters/dex/convert.py`, `converters/diff/convert.py`).

Load the source in fp32, run calibration text through it once (attention entropy per head, RMS of
each head's output), rewrite the model in place (new config class + DEX/DIFF modules, source
weights untouched), check that the logits did not move, and save OUT atomically with the
modeling code (`auto_map`), the tokenizer, `attnkit_report.json` and a model card.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from attnkit import __version__
from attnkit.converters.common import DTYPES, calibration_tokens, check_device, source_dtype, source_info
from attnkit.converters.calibration import batches, calibrate
from attnkit.converters.shapes import check_weights
from attnkit.errors import AttnkitError
from attnkit.evaluation.kv import kv_as_stored, kv_cache_bytes_per_token, kv_change, short_dtype
from attnkit.io.checkpoint import LazyCheckpoint, atomic_output_dir, check_output_dir
from attnkit.io.model_card import write_model_card
from attnkit.io.resolve import check_causal_lm, resolve_model
from attnkit.sdpa import fused_kwargs

ANNEAL_FRACTION = 0.25  # λ (and DIFF's norm) ramp in over the first quarter of the fine-tune
EVAL_ROWS = 4

# (args, calibration stats, model_type, layers) -> (config.attnkit fields, report extras)
FieldsFn = Callable[[argparse.Namespace, dict, str, int], tuple[dict, dict]]
# (model after install, calibration stats) -> report extras
InitFn = Callable[[torch.nn.Module, dict], dict]


# ---------------------------------------------------------------- the shared driver


def retrofit(args: argparse.Namespace, method: str, fields_for: FieldsFn, init: InitFn | None = None,
             source_path: Path | None = None, prior: dict | None = None, original_path: Path | None = None) -> int:
    """Rewrite the source in place with `method`'s modules (config fields from `fields_for`, new
    weights set by `init`), check the logits, save OUT atomically. `prior`: the MLA report when
    the source is an MLA conversion of the user's model (`--to mla+dex`), `original_path` that
    model: the report's "before" (perplexity, KV cache) is the user's model, not the intermediate one."""
    from transformers import AutoTokenizer

    from attnkit.adapters.modeling_attnkit import CLASSES, install_retrofit

    path = source_path or resolve_model(args.model)
    check_output_dir(args.out, args.force, (path,))
    config = check_causal_lm(path)
    model_type = config.get("model_type", "")
    if model_type.startswith("attnkit_"):
        raise AttnkitError(f"{args.model} is already an attnkit {config.get('attnkit', {}).get('method')} model; convert its source")
    if model_type not in CLASSES:
        raise AttnkitError(
            f"attention of model_type {model_type!r} is not recognised for {method.upper()} "
            f"(supported: {', '.join(sorted(CLASSES))})"
        )
    check_weights(path, config)  # every tensor's shape against the config, from the headers
    device = check_device(args.device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises OSError/ValueError/… for a missing tokenizer
        raise AttnkitError(f"cannot load the tokenizer of {args.model} (needed for calibration): {str(exc).splitlines()[0]}") from None
    calib, evaluation, held_note = calibration_tokens(tokenizer, args.calib, args.calib_seq_len, args.calib_tokens,
                                                      EVAL_ROWS * args.calib_seq_len, args.seed)
    evaluation = evaluation[:EVAL_ROWS]
    eval_split = "validation" if held_note == "validation split" else "train"
    ppl_original = None if original_path is None else source_ppl(original_path, evaluation, device)

    model = load_fp32(path, device)
    src_dtype = source_dtype(LazyCheckpoint(path))
    stats = calibrate(model, calib, device)
    kv_before = _kv_bytes(model)
    logits_before = _logits(model, evaluation, device)

    # rewrite in place: same parameters, new config class + modules
    config_class, model_class = CLASSES[model_type]
    fields, extras = fields_for(args, stats, model_type, model.config.num_hidden_layers)
    model.config.__class__ = config_class
    model.config.attnkit = fields
    model.__class__ = model_class
    install_retrofit(model, model.config, model_type)
    if init is not None:
        extras.update(init(model, stats))
    model.to(device).eval()
    kv_after = _kv_bytes(model)
    logits_after = _logits(model, evaluation, device)
    step = {"name": f"insert {method} modules (ramp 0)", **_compare(logits_before, logits_after, evaluation)}
    step["exact"] = step["logits_rel_err_max"] == 0.0
    ppl_before = step.pop("ppl_before") if ppl_original is None else ppl_original

    out_dtype = DTYPES[args.dtype] if args.dtype else src_dtype
    # measured on the fp32 model; counted in out_dtype, the dtype the output is stored (and served) in
    kv_before, kv_after = (kv_as_stored(b, torch.float32, out_dtype)["bytes_per_token"] for b in (kv_before, kv_after))
    report = {
        "attnkit_version": __version__,
        "method": method,
        "source": source_info(path, model_type, args.model),
        "settings": _settings(args),
        "kv_cache_bytes_per_token": {"before": kv_before, "after": kv_after, "dtype": short_dtype(out_dtype)},
        "kv_cache_effect": "unchanged: Q, K, V and the cache are the source's",
        "steps": [*(prior or {}).get("steps", []), step],
        "ppl": {"before": ppl_before, "after": step["ppl"], "split": eval_split},
        "load": {**(prior or {}).get("load", {}), "trust_remote_code": True},
        "calibration": {"rows": int(calib.shape[0]), "seq_len": int(calib.shape[1]), "source": args.calib},
        "anneal_fraction": ANNEAL_FRACTION,
        **({"lambda_init": fields["lambda_init"]} if "lambda_init" in fields else {}),  # DEX/DIFF
        "output_dtype": str(out_dtype).replace("torch.", ""),
        **extras,
    }
    if prior is not None:
        report.update(_against_original(report, prior, args.model, kv_before))
    with atomic_output_dir(args.out, args.force, (path,)) as tmp:
        model.to("cpu", out_dtype).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "attnkit_report.json").write_text(json.dumps(report, indent=2))
        write_model_card(tmp)
    print(_summary(report, args.out))
    return 0


# ---------------------------------------------------------------- calibration and measurement


@torch.no_grad()
def retrofit_after_mla(args: argparse.Namespace, method: str, fields_for: FieldsFn, init: InitFn | None = None,
                       convert_mla: Callable[[argparse.Namespace], int] | None = None) -> int:
    """`--to mla+<method>`: MLA first (`convert_mla`, default the MLA driver, into a scratch folder
    beside OUT that a killed run's successor removes), then the retrofit on its DeepSeek-V3 output;
    the report's "before" is the user's model."""
    import copy

    from attnkit.io.checkpoint import scratch_dir

    if convert_mla is None:
        from attnkit.converters.mla.convert import convert as convert_mla

    original = resolve_model(args.model)
    check_output_dir(args.out, args.force, (original,))
    with scratch_dir(args.out) as scratch:
        mla_out = scratch / "mla"
        mla_args = copy.copy(args)
        mla_args.to, mla_args.out, mla_args.force = "mla", str(mla_out), False
        convert_mla(mla_args)
        prior = json.loads((mla_out / "attnkit_report.json").read_text())
        return retrofit(args, method, fields_for, init, source_path=mla_out, prior=prior, original_path=original)


@torch.no_grad()  # a comparison: no graph (it held every layer's activations and warned)
def _logits(model, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.cat([model(input_ids=b.to(device), use_cache=False).logits.float().cpu() for b in batches(rows)])


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
    return int(kv_cache_bytes_per_token(model)["total"])


def load_fp32(path: Path, device: torch.device):
    """The model in `path` in fp32 with SDPA attention (fused, V zero-padded for MLA's head sizes): no
    pass after calibration needs the attention probabilities, and eager's [B, H, T, T] scores at a
    long measurement context (Titans' state at 4 windows) would not fit."""
    from transformers import AutoModelForCausalLM

    implementation = fused_kwargs(path).get("attn_implementation", "sdpa")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=implementation).to(device).eval()


@torch.no_grad()
def source_ppl(path: Path, rows: torch.Tensor, device: torch.device) -> float:
    """Perplexity of the model in `path` on `rows` (fp32, freed afterwards): the "before" of a
    retrofit whose input is an intermediate model (`mla+dex` runs DEX on the MLA conversion)."""
    model = load_fp32(path, device)
    try:
        return _ppl(_logits(model, rows, device), rows)
    finally:
        del model


def _against_original(report: dict, prior: dict, model: str, kv_intermediate: int) -> dict:
    """The `mla+dex` report's fields that speak of the user's model (from the MLA report), not of the
    MLA folder DEX was run on: source, KV cache before (and so the fraction), what loading needs.
    The MLA-only load notes (oldest transformers, engines) do not hold for the remote-code output."""
    kv_prior = prior.get("kv_cache_bytes_per_token") or {}
    before = kv_prior.get("before", kv_intermediate)
    after, dtype = report["kv_cache_bytes_per_token"]["after"], report["kv_cache_bytes_per_token"]["dtype"]
    load = {k: v for k, v in (prior.get("load") or {}).items() if k not in ("min_transformers", "needs")}
    return {
        "source": {**prior.get("source", {}), "model": model},
        "kv_cache_bytes_per_token": {"before": before, "after": after, "dtype": dtype},
        "kv_cache_fraction": after / before if before else None,
        "kv_cache_effect": "the MLA conversion's latent cache; DEX leaves Q, K, V and that cache untouched",
        "load": {**load, "trust_remote_code": True},
        "mla": {k: v for k, v in prior.items() if k not in ("steps", "source", "settings", "load")},
    }


# ---------------------------------------------------------------- small helpers


def _settings(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None))) and k != "command"}


def _summary(report: dict, out: str) -> str:
    step = report["steps"][-1]
    # after MLA (`mla+…`) the inserted modules are exact on the MLA model, while the perplexity's "before" is
    # the user's model: the change is the MLA step's, not this one's
    on = " on the MLA model" if "mla" in report else ""
    lossy = "; the change is the MLA step's" if "mla" in report else ""
    lines = [
        f"attnkit convert --to {report['method']}: wrote {out}",
        f"  {step['name']}{on}: logits rel. error max {step['logits_rel_err_max']:.2e} (exact: {step['exact']}); "
        f"ppl {report['ppl']['before']:.3f} -> {report['ppl']['after']:.3f} ({report['ppl']['split']}{lossy})",
        "  " + kv_change(report["kv_cache_bytes_per_token"]),  # before: the user's model, also for mla+dex
    ]
    if "titans" in report:
        from attnkit.evaluation.kv import bounded_state_note

        lines[-1] += f"; {bounded_state_note(report['titans'])}"
    if "heads" in report:
        sel = report["heads"]["selected"]
        lines.append(f"  DEX heads per layer: {[len(s) for s in sel]} of {report['heads']['num_heads']} ({report['heads']['rule']})")
    if "titans" in report:
        t = report["titans"]
        state = ", ".join(f"{b:,} B at {n}" for n, b in zip(t["state_bytes"]["contexts"], t["state_bytes"]["bytes"]))
        lines.append(f"  Titans: window {t['window']}, chunk {t['chunk']}, memory depth {t['memory_depth']} x dim "
                     f"{t['memory_dim']}; whole cache after a forward pass (fp32): {state} tokens")
    return "\n".join(lines)
