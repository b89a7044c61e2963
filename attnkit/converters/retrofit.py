"""The in-place retrofit shared by `attnkit convert --to dex | diff | titans | mla+dex | mla+titans`
(their entry points: `converters/<method>/convert.py`, each a `RetrofitMethod`).

Calibration text through the source (attention entropy per head, RMS of each head's output), the
method's modules added to every layer (new config class, source weights untouched), the logits
checked unchanged on held-out rows, and OUT saved atomically with the modeling code (`auto_map`),
the tokenizer, `attnkit_report.json` and a model card. All of it streamed a layer at a time
(`retrofit_stream.py`): memory is one layer plus a few rows of hidden states, whatever the depth.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from attnkit import __version__
from attnkit.converters.common import DTYPES, calibration_tokens, check_device, source_info
from attnkit.converters.measure import return_freed_memory
from attnkit.converters.mla.source import Source, open_source
from attnkit.converters.retrofit_stream import (InitLayerFn, calibration_pass, held_out_metrics, open_streams,
                                                per_layer_measure, retrofit_config, rewrite_pass, streamed_ppl,
                                                write_config)
from attnkit.converters.stream.outside import write_outside_layers
from attnkit.errors import AttnkitError
from attnkit.evaluation.ppl import held_out
from attnkit.evaluation.kv import kv_as_stored, kv_cache_bytes_per_token, kv_change, short_dtype
from attnkit.io.checkpoint import ShardedWriter, atomic_output_dir, check_output_dir
from attnkit.card.build import write_model_card
from attnkit.io.resolve import resolve_model

ANNEAL_FRACTION = 0.25  # λ (and DIFF's norm) ramp in over the first quarter of the fine-tune
EVAL_ROWS = 4

# (args, calibration stats, model_type, layers) -> (config.attnkit fields, report extras)
FieldsFn = Callable[[argparse.Namespace, dict, str, int], tuple[dict, dict]]
# (the output's config, its model class) -> report extras measured on the written form (Titans' state)
ExtrasFn = Callable[[object, type], dict]


@dataclass(frozen=True)
class RetrofitMethod:
    """What a retrofit adds to the shared driver: its config fields (from the calibration statistics),
    how each layer's new weights start, and what its report adds."""

    name: str
    fields: FieldsFn
    init_layer: InitLayerFn | None = None
    extras: ExtrasFn | None = None


# ---------------------------------------------------------------- the shared driver


def retrofit(args: argparse.Namespace, method: RetrofitMethod, source_path: Path | None = None,
             prior: dict | None = None, original_path: Path | None = None) -> int:
    """Rewrite the source with `method`'s modules, check the logits, save OUT atomically. `prior`: the
    MLA report when the source is an MLA conversion of the user's model (`--to mla+dex`),
    `original_path` that model: the report's "before" (perplexity, KV cache) is the user's model,
    not the intermediate one."""
    from transformers import AutoTokenizer

    from attnkit.adapters.modeling_attnkit import CLASSES

    started = time.time()
    path = source_path or resolve_model(args.model)
    check_output_dir(args.out, args.force, (path,))
    src = open_source(str(path), _family_check(method.name, args.model), args.calib_dtype, args.device)
    model_type = src.config["model_type"]
    device = check_device(args.device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises OSError/ValueError/… for a missing tokenizer
        raise AttnkitError(f"cannot load the tokenizer of {args.model} (needed for calibration): {str(exc).splitlines()[0]}") from None
    held_rows = max(1, (args.eval_tokens or EVAL_ROWS * args.calib_seq_len) // args.calib_seq_len)
    calib, evaluation, held_note = calibration_tokens(tokenizer, args.calib, args.calib_seq_len, args.calib_tokens,
                                                      held_rows * args.calib_seq_len, args.seed)
    evaluation = evaluation[:held_rows]
    out_dtype = DTYPES[args.dtype] if args.dtype else src.dtype
    config_class, model_class = CLASSES[model_type]
    with atomic_output_dir(args.out, args.force, (path,)) as tmp:
        scratch = tmp / ".scratch"
        scratch.mkdir()
        try:
            original = None if original_path is None else open_source(str(original_path), calib_dtype=args.calib_dtype,
                                                                       device=args.device)
            ppl_original = None if original is None else streamed_ppl(original, evaluation, scratch, device)
            config, stats, step = _stream(args, method, src, calib, evaluation, out_dtype, config_class, model_class,
                                          tmp, scratch, device)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        kv_before, kv_after = (_kv_bytes(c, m) for c, m in ((src.hf_config, src.family.causal_lm_class()),
                                                             (config, model_class)))
        extras = {**step.pop("extras"), **(method.extras(config, model_class) if method.extras else {})}
        report = _report(args, method.name, src, stats, step, (kv_before, kv_after), out_dtype, config.attnkit,
                         ppl_original, held_note, calib, extras, prior)
        report["calibration"].update(**src.calib_note, held_out_rows=int(evaluation.shape[0]))
        report["wall_time_s"] = round(time.time() - started, 2)
        write_config(src, config, model_class, out_dtype, tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "attnkit_report.json").write_text(json.dumps(report, indent=2))
        write_model_card(tmp)
    print(_summary(report, args.out))
    return 0


def _stream(args: argparse.Namespace, method: RetrofitMethod, src: Source, calib: torch.Tensor, evaluation: torch.Tensor,
            out_dtype: torch.dtype, config_class: type, model_class: type, tmp: Path, scratch: Path, device) -> tuple:
    """The two passes (`retrofit_stream.py`): statistics, then the rewritten layers written to `tmp`;
    returns (the output's config, the statistics, the exactness step with the fields' report extras)."""
    return_freed_memory()  # from the first layer on: large temporaries mmapped, returned to the OS when freed
    calib_rows, before = open_streams(src, calib, evaluation, scratch)
    after = before.copy(scratch / "after.f32")
    stats = calibration_pass(src, calib_rows, before, device)
    calib_rows.close()
    fields, extras = method.fields(args, stats, src.config["model_type"], src.config["num_hidden_layers"])
    config = retrofit_config(src, config_class, fields)
    writer = ShardedWriter(tmp)
    rewrite_pass(src, config, src.config["model_type"], method.init_layer, stats, after, writer, out_dtype, device)
    write_outside_layers(src, tmp, writer, out_dtype)
    metrics = held_out_metrics(src, before, after, evaluation, device)
    step = {"name": f"insert {method.name} modules (ramp 0)", **metrics, "extras": extras}
    step["exact"] = step["logits_rel_err_max"] == 0.0
    return config, stats, step


def _family_check(method: str, model: str):
    """open_source's check: a family whose attention the runtime retrofit knows (not an attnkit output)."""
    from attnkit.adapters.families import FAMILIES
    from attnkit.adapters.modeling_attnkit import CLASSES

    def check(config: dict):
        model_type = config.get("model_type", "")
        if model_type.startswith("attnkit_"):
            raise AttnkitError(f"{model} is already an attnkit {config.get('attnkit', {}).get('method')} model; convert its source")
        if model_type not in CLASSES:
            raise AttnkitError(f"attention of model_type {model_type!r} is not recognised for {method.upper()} "
                               f"(supported: {', '.join(sorted(CLASSES))})")
        return FAMILIES[model_type]

    return check


def _report(args: argparse.Namespace, method: str, src: Source, stats: dict, step: dict, kv: tuple[int, int],
            out_dtype: torch.dtype, fields: dict, ppl_original: float | None, held_note: str, calib: torch.Tensor,
            extras: dict, prior: dict | None) -> dict:
    # measured in fp32; counted in out_dtype, the dtype the output is stored (and served) in
    kv_before, kv_after = (kv_as_stored(b, torch.float32, out_dtype)["bytes_per_token"] for b in kv)
    ppl_before = step.pop("ppl_before") if ppl_original is None else ppl_original
    report = {
        "attnkit_version": __version__,
        "method": method,
        "source": source_info(src.path, src.config["model_type"], args.model),
        "settings": _settings(args),
        "kv_cache_bytes_per_token": {"before": kv_before, "after": kv_after, "dtype": short_dtype(out_dtype)},
        "kv_cache_effect": "unchanged: Q, K, V and the cache are the source's",
        "steps": [*(prior or {}).get("steps", []), step],
        "ppl": {"before": ppl_before, "after": step["ppl"],
                "split": "validation" if held_note == "validation split" else "train"},
        "load": {**(prior or {}).get("load", {}), "trust_remote_code": True},
        "calibration": {"rows": int(calib.shape[0]), "seq_len": int(calib.shape[1]), "source": args.calib,
                        "held_out_from": held_note},
        "anneal_fraction": ANNEAL_FRACTION,
        **({"lambda_init": fields["lambda_init"]} if "lambda_init" in fields else {}),  # DEX/DIFF
        "output_dtype": str(out_dtype).replace("torch.", ""),
        **extras,
    }
    if prior is not None:
        report.update(_against_original(report, prior, args.model, kv_before))
    return report


def retrofit_after_mla(args: argparse.Namespace, method: RetrofitMethod,
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
    _check_mla_output_format(args, original, method.name)
    with scratch_dir(args.out) as scratch:
        mla_out = scratch / "mla"
        mla_args = copy.copy(args)
        mla_args.to, mla_args.out, mla_args.force = "mla", str(mla_out), False
        mla_args.announce = False
        convert_mla(mla_args)
        prior = json.loads((mla_out / "attnkit_report.json").read_text())
        return retrofit(args, method, source_path=mla_out, prior=prior, original_path=original)


def _check_mla_output_format(args: argparse.Namespace, source: Path, method: str) -> None:
    """Before any work: the MLA step of a QK-norm source (Qwen3, OLMo-2, ...) keeps its q/k norms in
    attnkit's own format by default, and the retrofits take DeepSeek-V3 checkpoints, not that format."""
    from attnkit.adapters.families import FAMILIES
    from attnkit.converters.mla.settings import output_format

    model_type = json.loads((Path(source) / "config.json").read_text()).get("model_type")
    family = FAMILIES.get(model_type)
    if family is not None and family.qk_norm is not None and output_format(args, family) == "attnkit":
        raise AttnkitError(f"--to {args.to} cannot take {model_type} as it is: its MLA step keeps the q/k norms in "
                           f"attnkit's own format, which {method.upper()} does not retrofit; add --format deepseek_v3 "
                           "(folds the norms, lossy) or convert with --to mla")


def _kv_bytes(config, model_class: type) -> int:
    """KV-cache bytes per token (fp32, batch 1) of the model `config` describes, measured from the cache
    of a one-layer twin per layer type (`retrofit_stream.one_layer_twin`)."""
    return int(sum(per_layer_measure(config, model_class, lambda twin: kv_cache_bytes_per_token(twin)["total"])))


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
    from attnkit import registry

    step = report["steps"][-1]
    # after MLA (`mla+…`) the inserted modules are exact on the MLA model, while the perplexity's "before" is
    # the user's model: the change is the MLA step's, not this one's
    on = " on the MLA model" if "mla" in report else ""
    lossy = " (the change is the MLA step's)" if "mla" in report else ""
    lines = [
        f"attnkit convert --to {report['method']}: wrote {out}",
        f"  {step['name']}{on}: logits rel. error max {step['logits_rel_err_max']:.2e} "
        f"({'logits unchanged by this step' if step['exact'] else 'this step changes the logits'}); "
        f"{held_out(report.get('calibration'))} {report['ppl']['before']:.3f} -> {report['ppl']['after']:.3f}{lossy}",
        "  " + kv_change(report["kv_cache_bytes_per_token"]),  # before: the user's model, also for mla+dex
    ]
    method = registry.get(report["method"])
    if method.summary:  # the method's own lines; a note on its cache goes on the KV line
        kv_note, extra = registry.load(method.summary)(report)
        if kv_note:
            lines[-1] += f"; {kv_note}"
        lines += [f"  {line}" for line in extra]
    return "\n".join(lines)
