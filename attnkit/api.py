"""The Python API: what the command line does, callable from a notebook or a pipeline.

    import attnkit
    from attnkit.converters.mla.config import MLAConfig

    report = attnkit.convert("reference", to="mla", out="out/ref-mla",
                             config=MLAConfig(kv_lora_rank=28, rope_dim=48, report="final"))
    report.kv_cache_fraction

Each function builds the settings the CLI would parse (its defaults are the CLI's: one parser is the
source of truth), runs the same checks and the same handler, and returns what was written. A refusal is
the `AttnkitError` the CLI prints, with the same one line.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnkit.errors import AttnkitError

PathLike = str | os.PathLike


@dataclass
class Report:
    """A written folder and its report (`attnkit_report.json` after convert, `finetune_report.json` after
    heal). `report["key"]` reads the JSON; the common figures are properties."""

    path: Path
    data: dict = field(repr=False)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    @property
    def method(self) -> str | None:
        return self.data.get("method")

    @property
    def kv_cache_fraction(self) -> float | None:
        """KV-cache bytes per token after / before (the cache of the model the user gave)."""
        kv = self.data.get("kv_cache_bytes_per_token") or {}
        return kv["after"] / kv["before"] if kv.get("before") else None

    @property
    def ppl(self) -> dict | None:
        """Held-out perplexity before and after, as the printout states it."""
        return self.data.get("ppl")


def _parse(argv: list[str]) -> argparse.Namespace:
    from attnkit.cli import build_parser

    return build_parser().parse_args(argv)


def _run(args: argparse.Namespace) -> Any:
    from attnkit.cli import run

    return run(args)


def convert(model: PathLike, to: str, out: PathLike, config: Any = None, **options: Any) -> Report:
    """`attnkit convert --to TO MODEL -o OUT`: rewrite MODEL's attention into OUT (atomically).

    config: the method's option class instance(s) (`MLAConfig`, `DexConfig`, `DiffConfig`, `GQAConfig`,
    `TitansConfig`; a tuple for `mla+dex` / `mla+titans`); options: the common ones
    (`attnkit.converters.options.ConvertOptions`: calib, calib_tokens, calib_seq_len, eval_tokens,
    seed, dtype, device, force, eval, tasks, limit). Returns OUT's report."""
    from attnkit import registry
    from attnkit.converters.options import ConvertOptions
    from attnkit.options import apply_options, check_types, into_namespace

    method = registry.get(to)
    args = _parse(["convert", "--to", to, str(model), "-o", str(out)])
    configs = config if isinstance(config, (tuple, list)) else ([] if config is None else [config])
    for cfg in configs:
        if type(cfg) not in method.configs:
            takes = ", ".join(c.__name__ for c in method.configs) or "none"
            raise AttnkitError(f"--to {to} does not take {type(cfg).__name__} (it takes: {takes})")
        check_types(cfg)
        into_namespace(cfg, args)
    apply_options(args, ConvertOptions, options, "convert", "; a method's own go in its config")
    _run(args)
    return Report(Path(out), json.loads((Path(out) / "attnkit_report.json").read_text()))


def heal(recipe: PathLike, **overrides: Any) -> Report:
    """`attnkit finetune --config RECIPE key=value ...`: heal a converted model from a YAML recipe.
    Dotted keys go through a dict: `heal("recipes/heal-mla.yaml", model="out/ref-mla",
    output_dir="out/healed", **{"train.max_steps": 20})`. Returns the output folder's finetune report."""
    from attnkit.training.finetune import run
    from attnkit.training.recipe import load_finetune_recipe

    items = [f"{k}={v if isinstance(v, str) else json.dumps(str(v) if isinstance(v, Path) else v)}"
             for k, v in overrides.items()]
    loaded = load_finetune_recipe(str(recipe), items)
    run(loaded, config_path=str(recipe))
    out = Path(loaded.output_dir)
    report = out / "finetune_report.json"
    return Report(out, json.loads(report.read_text()) if report.is_file() else {})


def evaluate(model: Any, baseline: Any = None, *, tokenizer: Any = None, baseline_tokenizer: Any = None,
             out: PathLike | None = None, **options: Any) -> dict:
    """`attnkit eval MODEL --baseline BASELINE`: lm-eval on the bundled (or any) tasks.
    MODEL and BASELINE are MODEL specs (a folder, a Hub id, a bundled name) or in-memory models, each then
    with its tokenizer. options: `attnkit.evaluation.options.EvalOptions`' fields (tasks, a name or a list;
    limit, batch_size, dtype, device, verbose), with the command's defaults. Returns the results
    `attnkit eval --out` writes (with `retention` when there is a baseline); `out` writes them too."""
    from attnkit.cli import check_arguments
    from attnkit.evaluation import tasks as bundled
    from attnkit.evaluation.options import EvalOptions
    from attnkit.evaluation.run import check_inputs, evaluate_all, run_eval
    from attnkit.options import apply_options

    if isinstance(options.get("tasks"), (list, tuple)):
        options["tasks"] = ",".join(options["tasks"])
    args = _measured_args("eval", model, baseline, out)
    settings = apply_options(args, EvalOptions, options, "evaluate")
    check_arguments(args)
    if all(isinstance(m, (str, os.PathLike)) for m in (model, baseline) if m is not None):
        return run_eval(args)  # the command itself: the same checks, table and file
    if out is not None:
        raise AttnkitError("out= is for models given as folders or names (the file names them); with an in-memory "
                           "model, write the returned dict yourself")
    names = bundled.expand(settings.tasks)
    bundled.check_names_without_index(names)
    specs = {"model": model, **({"baseline": baseline} if baseline is not None else {})}
    check_inputs([s for s in specs.values() if isinstance(s, (str, os.PathLike))])
    return evaluate_all(specs, names, settings.limit, settings.batch_size, settings.dtype, settings.device,
                        settings.verbose, tokenizers={"model": tokenizer, "baseline": baseline_tokenizer})


def bench(model: Any, baseline: Any = None, *, out: PathLike | None = None, **options: Any) -> dict:
    """`attnkit bench MODEL --baseline BASELINE`: prefill/decode speed, peak memory, KV-cache bytes.
    MODEL and BASELINE are MODEL specs or in-memory models; an in-memory model is measured in its own dtype
    and on its own device (both models then on that one), and `attn` switches an MLA model's attention
    path in place. options: `attnkit.evaluation.options.BenchOptions`' fields (context, batch,
    decode_tokens, repeats, attn, baseline_attn, threads, clock, prefill_chunk, dtype, device), with the
    command's defaults. Returns the results `--out` writes."""
    from attnkit.cli import check_arguments
    from attnkit.evaluation.bench import measure
    from attnkit.evaluation.options import BenchOptions
    from attnkit.options import apply_options

    args = _measured_args("bench", model, baseline, out)
    apply_options(args, BenchOptions, options, "bench")
    in_memory = [m for m in (model, baseline) if m is not None and not isinstance(m, (str, os.PathLike))]
    if in_memory:
        args.dtype, args.device = _placement(in_memory, options)
    check_arguments(args)
    return measure(args)


def _placement(models: list, options: dict[str, Any]) -> tuple[str, str]:
    """(dtype, device) of in-memory models, as bench names them: they are measured where they are, so
    dtype= and device= are refused for them, as are two models in different places."""
    from attnkit.evaluation.kv import short_dtype
    from attnkit.evaluation.options import DTYPES

    if "dtype" in options or "device" in options:
        raise AttnkitError("an in-memory model is benchmarked in its own dtype and on its own device; "
                           "move it first (model.to(...)) instead of passing dtype= or device=")
    places = {(short_dtype(p.dtype), str(p.device)) for p in (next(m.parameters()) for m in models)}
    if len(places) > 1:
        raise AttnkitError(f"the in-memory models are in different dtypes or devices ({sorted(places)}); "
                           "bench measures both in one")
    dtype, device = places.pop()
    if dtype not in DTYPES:
        raise AttnkitError(f"bench measures {', '.join(DTYPES)} models, not {dtype}; move the model first (model.to(...))")
    return dtype, device


def _measured_args(command: str, model: Any, baseline: Any, out: PathLike | None) -> argparse.Namespace:
    """The command's parsed defaults with the models and --out set (an in-memory model is kept as it is)."""
    args = _parse([command, "MODEL"])
    args.model, args.baseline = (m if m is None or not isinstance(m, os.PathLike) else str(m) for m in (model, baseline))
    args.out = None if out is None else str(out)
    return args


def push(folder: PathLike, repo_id: str, *, private: bool = False, revision: str | None = None,
         create_pr: bool = False, token: str | None = None, endpoint: str | None = None) -> str:
    """`attnkit push OUT --repo-id USER/NAME`: upload a written folder with its model card; returns the URL."""
    from attnkit.io.hub import push as upload

    return upload(str(folder), repo_id, token=token, endpoint=endpoint, private=private, revision=revision,
                  create_pr=create_pr)
