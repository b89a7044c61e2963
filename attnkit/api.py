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
from collections.abc import Mapping
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
    from attnkit.options import check_types, fields_of, from_namespace, into_namespace

    method = registry.get(to)
    args = _parse(["convert", "--to", to, str(model), "-o", str(out)])
    configs = config if isinstance(config, (tuple, list)) else ([] if config is None else [config])
    for cfg in configs:
        if type(cfg) not in method.configs:
            takes = ", ".join(c.__name__ for c in method.configs) or "none"
            raise AttnkitError(f"--to {to} does not take {type(cfg).__name__} (it takes: {takes})")
        check_types(cfg)
        into_namespace(cfg, args)
    known = {f.name for f, _ in fields_of(ConvertOptions)}
    for key, value in options.items():
        if key not in known:
            raise AttnkitError(f"convert() has no option {key!r} (common options: {', '.join(sorted(known))}; "
                               f"a method's own go in its config)")
        setattr(args, key, value)
    check_types(from_namespace(ConvertOptions, args))
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


def evaluate(model: Any, baseline: Any = None, tasks: str | list[str] = "attnkit-quick", *, limit: int | None = None,
             batch_size: int = 4, dtype: str = "fp32", device: str | None = None, tokenizer: Any = None,
             baseline_tokenizer: Any = None, out: PathLike | None = None, verbose: bool = False) -> dict:
    """`attnkit eval MODEL --baseline BASELINE --tasks TASKS`: lm-eval on the bundled (or any) tasks.
    MODEL and BASELINE are MODEL specs (a folder, a Hub id, a bundled name) or in-memory models, each then
    with its tokenizer. Returns the results `attnkit eval --out` writes (with `retention` when there is a
    baseline); `out` writes them too."""
    from attnkit.evaluation import tasks as bundled
    from attnkit.cli import check_arguments
    from attnkit.evaluation.run import check_inputs, evaluate_all, run_eval

    in_memory = not isinstance(model, (str, os.PathLike)) or (baseline is not None
                                                              and not isinstance(baseline, (str, os.PathLike)))
    if not in_memory:  # the command itself: the same checks, table and file
        argv = ["eval", str(model), "--tasks", tasks if isinstance(tasks, str) else ",".join(tasks),
                "--batch-size", str(batch_size), "--dtype", dtype]
        argv += [*(["--baseline", str(baseline)] if baseline is not None else []),
                 *(["--limit", str(limit)] if limit is not None else []), *(["--device", device] if device else []),
                 *(["--out", str(out)] if out else []), *(["--verbose"] if verbose else [])]
        args = _parse(argv)
        check_arguments(args)
        return run_eval(args)
    if out is not None:
        raise AttnkitError("out= is for models given as folders or names (the file names them); with an in-memory "
                           "model, write the returned dict yourself")
    names = bundled.expand(tasks) if isinstance(tasks, str) else list(tasks)
    bundled.check_names_without_index(names)
    specs = {"model": model, **({"baseline": baseline} if baseline is not None else {})}
    check_inputs([s for s in specs.values() if isinstance(s, (str, os.PathLike))])
    return evaluate_all(specs, names, limit, batch_size, dtype, device, verbose,
                        tokenizers={"model": tokenizer, "baseline": baseline_tokenizer})


def bench(model: PathLike, baseline: PathLike | None = None, *, context: tuple[int, ...] | list[int] = (1024, 4096, 16384),
          batch: tuple[int, ...] | list[int] = (1,), out: PathLike | None = None, **options: Any) -> dict:
    """`attnkit bench MODEL --baseline BASELINE`: prefill/decode speed, peak memory, KV-cache bytes.
    options: the command's other flags by their names (decode_tokens, repeats, attn, dtype, device,
    threads, clock, prefill_chunk). Returns the results `--out` writes."""
    from attnkit.evaluation.bench import measure

    argv = ["bench", str(model), "--context", ",".join(map(str, context)), "--batch", ",".join(map(str, batch))]
    argv += [*(["--baseline", str(baseline)] if baseline is not None else []), *(["--out", str(out)] if out else [])]
    args = _parse(argv)
    _set_options(args, options, "bench")
    from attnkit.cli import check_arguments

    check_arguments(args)
    return measure(args)


def push(folder: PathLike, repo_id: str, *, private: bool = False, revision: str | None = None,
         create_pr: bool = False, token: str | None = None, endpoint: str | None = None) -> str:
    """`attnkit push OUT --repo-id USER/NAME`: upload a written folder with its model card; returns the URL."""
    from attnkit.io.hub import push as upload

    return upload(str(folder), repo_id, token=token, endpoint=endpoint, private=private, revision=revision,
                  create_pr=create_pr)


def _set_options(args: argparse.Namespace, options: Mapping[str, Any], command: str) -> None:
    for key, value in options.items():
        if not hasattr(args, key) or key in ("command", "model", "baseline", "out"):
            raise AttnkitError(f"{command}() has no option {key!r}")
        setattr(args, key, value)
