"""What `convert --to mla` prints and its card states besides the step table (issue 29): the parameters
before and after with why they grew, the wording of exactness, a short `runs in:` line."""

import json
import sys
from pathlib import Path

import pytest

from attnkit.cli import main
from attnkit.converters.params import counts_by_part
from attnkit.io.checkpoint import LazyCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import save_model  # noqa: E402

FAST = ["--calib-tokens", "256", "--calib-seq-len", "32", "--eval-tokens", "128"]
TARGETS = {  # --target: the split (tiny smollm: G = 2 KV heads of d = 16, tied embeddings)
    "engines": ["--kv-lora-rank", "17", "--rope-dim", "8"],
    "transformers": ["--kv-lora-rank", "33", "--rope-dim", "32", "--dtype", "fp32"],  # full size: exact
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, calib):
    """Both targets converted from one tied source: {target: (report, printed, card)}."""
    import io
    from contextlib import redirect_stdout

    base = tmp_path_factory.mktemp("summary")
    src = save_model(base / "src", "smollm")
    out = {}
    for target, split in TARGETS.items():
        folder = base / target
        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = main(["convert", "--to", "mla", str(src), "-o", str(folder), "--calib", str(calib), "--target", target,
                       *FAST, *split])
        assert rc == 0
        out[target] = (json.loads((folder / "attnkit_report.json").read_text()), buf.getvalue(),
                       (folder / "README.md").read_text(), folder, src)
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_parameters_before_after_and_why(runs, target):
    report, printed, card, folder, src = runs[target]
    params = report["params"]
    # the counts are the checkpoints' own
    assert params["before"] == sum(counts_by_part(LazyCheckpoint(src).shapes()).values())
    assert params["after"] == sum(counts_by_part(LazyCheckpoint(folder).shapes()).values())
    assert params["after"] > params["before"] and params["ratio"] == pytest.approx(params["after"] / params["before"], abs=1e-4)
    parts = params["by_part"]
    assert sum(e["after"] - e["before"] for e in parts.values()) == params["after"] - params["before"]
    for part, entry in parts.items():  # every part that changed says why
        assert (entry["after"] != entry["before"]) == bool(entry.get("why")), (part, entry)
    # the tied source's LM head: written by the engine form only
    assert parts["LM head"]["before"] == 0 if "LM head" in parts else True
    assert ("LM head" in parts and parts["LM head"]["after"] > 0) == (target == "engines")
    assert "untied" in (parts.get("LM head") or {}).get("why", "untied")
    assert "query gains the" in parts["queries"]["why"]
    # printed: the totals and a few words per changed part; the card: the table with the reasons in full
    assert f"parameters: {params['before']:,} -> {params['after']:,} (x{params['ratio']:.3f})" in printed
    assert f"  queries {parts['queries']['after'] - parts['queries']['before']:+,} (query 16 -> " in printed
    assert f"Parameters: {params['before']:,} before → {params['after']:,} after" in card
    assert f"| queries | {parts['queries']['before']:,} | {parts['queries']['after']:,} |" in card


def _table(printed: str) -> list[list[str]]:
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("step "))
    return [line.split() for line in lines[start + 2:] if line.split() and line.split()[0] in
            ("exact", "rope", "balance", "low-rank", "refit", "native")]


@pytest.mark.parametrize("target", TARGETS)
def test_exact_only_where_the_step_leaves_the_logits_unchanged(runs, target):
    report, printed, card, _, _ = runs[target]
    head = printed.splitlines()[next(i for i, line in enumerate(printed.splitlines()) if line.startswith("step "))]
    assert head.split()[:3] == ["step", "step", "alone"] and " exact " not in head
    assert "True" not in printed and "False" not in printed  # no bare flag that reads like a pass/fail
    rows = {r[0]: r for r in _table(printed)}
    for step in report["steps"]:
        word = rows[step["name"]][1] if step["alone"] != "engine form" else " ".join(rows[step["name"]][1:3])
        assert word == step["alone"]
        if step["alone"] == "exact":
            assert step["exact"] and step["name"] != "native"
    native = next(s for s in report["steps"] if s["name"] == "native")
    assert native["alone"] == ("engine form" if target == "engines" else "rounding") and native["exact"] is False
    assert ("engine form: latent norm without a bias, lossy" in printed) == (target == "engines")
    if target == "transformers":  # full size, fp32: nothing lossy, the logits unchanged but for rounding
        assert {s["alone"] for s in report["steps"]} == {"exact", "rounding"}
        assert max(s["logits_rel_err_max"] for s in report["steps"]) < 1e-4
    else:
        assert {s["name"] for s in report["steps"] if s["alone"] == "lossy"} >= {"rope", "low-rank"}
    assert "| step | step alone |" in card and f"| native | {native['alone']} |" in card


def test_runs_in_is_one_short_line_and_the_reasons_are_in_the_report_and_card(runs):
    from attnkit.converters.mla.engines import engine_support
    from attnkit.converters.mla.report import ATTNKIT_SERVING, runs_in

    for target, (report, printed, card, _, _) in runs.items():
        line = next(line for line in printed.splitlines() if line.startswith("runs in:"))
        assert line == runs_in(report["serving"]) and len(line) <= 120, line
        for engine, verdict in report["serving"].items():
            assert engine in line
            assert f"- {engine}: {verdict}" in card  # each reason in full, where the line sends the reader
    # the longest cases: every engine named, none over 120 characters
    for serving in (engine_support(28, 48, 64, 64, "engines"), engine_support(129, 128, 64, 64, "transformers", "exact"),
                    engine_support(512, 64, 128, 128, "engines"), ATTNKIT_SERVING):
        line = runs_in(serving)
        assert len(line) <= 120 and all(engine in line for engine in serving), line
    assert runs_in(engine_support(28, 48, 64, 64, "engines")) == (
        "runs in: transformers, llama.cpp, SGLang; not in: vLLM CUDA, vLLM CPU (why: `serving` in attnkit_report.json)")
