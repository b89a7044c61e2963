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
