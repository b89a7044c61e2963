"""benchmarks/dex_gains.py's comparison, table and plot from measured folders (synthetic measures)."""

from __future__ import annotations

import json
import random

from conftest import load_benchmark


def _measures(rng: random.Random, shift: float) -> dict:
    layers, rows, items = 2, 6, 20
    per = lambda base: [[base + rng.random() for _ in range(rows)] for _ in range(layers)]
    fp = [3 + rng.random() for _ in range(rows)]
    return {"distract": {"attnkit-distract-near": [int(rng.random() < 0.5 + shift) for _ in range(items)]},
            "nll": {"fp": fp, "w8": [x + 0.01 for x in fp], "w4": [x + 0.2 - shift for x in fp], "kv8": [x + 0.02 for x in fp]},
            "outliers": {k: {"kurtosis": per(4), "top1pct": per(2), "max": per(9)} for k in ("attention", "hidden")},
            "mass": {"needle": [rng.random() / 10 for _ in range(items)], "decoys": [rng.random() / 5 for _ in range(items)],
                     "needle_per_layer": []}}


def test_compare_table_and_plot(tmp_path):
    gains = load_benchmark("dex_gains.py", "dex_gains")
    rng = random.Random(0)
    arms = {}
    for arm, shift in (("lora", 0.0), ("dex", 0.1)):
        arms[arm] = []
        for seed in range(2):
            folder = tmp_path / f"{arm}-s{seed}"
            folder.mkdir()
            (folder / "robustness.json").write_text(json.dumps(_measures(rng, shift)))
            arms[arm].append(str(folder))
    out = tmp_path / "r.json"
    gains.write({"baseline": "lora", "arms": arms}, out)
    rows = json.loads(out.read_text())["comparisons"]["dex"]
    rise = rows["NLL rise, int4 weights"]
    assert abs(rise["difference"] + 0.1) < 1e-9 and rise["ci95"][0] <= -0.1 <= rise["ci95"][1]
    assert "mcnemar_p" in rows["distract-near acc"] and rows["distract-near acc"]["items"] == 20
    assert rows["distract-near acc"]["seeds"] == 2
    assert "| NLL rise, int4 weights | " in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 1000
