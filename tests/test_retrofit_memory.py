"""Every method streams: its peak memory does not grow with the number of layers.

Each `--to` runs in a subprocess on 2-, 6- and 10-layer models of the same width, and the least-squares
slope of its peak RSS against the layer count must stay under half a layer's fp32 weights per layer
(`memory_slope.assert_flat`: one run per depth, and a second of each, the lower kept, before a miss is judged;
38 MB of noise at one end moves the slope by 4.75 MB per layer, under the 7.5 MB bound).
Loading the whole model, as the retrofits did before they streamed, added 183 MB from 2 to 10 layers
for `--to dex` (503 -> 686 MB, 1.5 layers per layer; streamed: 473 -> 481 MB), so this cannot pass by
keeping every layer, nor fail by one noisy peak. `mla` has its own test (tests/test_mla_memory.py).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from memory_slope import assert_flat, layer_fp32_bytes, peak_rss  # noqa: E402
from mla_fixtures import calib_folder, save_model  # noqa: E402

WIDE = dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=1024)
DEPTHS = (2, 6, 10)
CALIB = ["--calib-tokens", "1024", "--calib-seq-len", "128"]
MLA = ["--kv-lora-rank", "64", "--rope-dim", "32", "--eval-tokens", "512"]
METHODS = {
    "dex": ["--heads", "auto"],
    "diff": [],
    "titans": ["--window", "64"],
    "gqa": ["--kv-heads", "1"],
    "mla+dex": MLA,
    "mla+titans": [*MLA, "--window", "64"],
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrofit-memory")
    models = {n: save_model(root / f"src{n}", "llama", num_hidden_layers=n, **WIDE) for n in DEPTHS}
    return models, calib_folder(root / "calib")


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_peak_memory_does_not_grow_with_layers(sources, method, tmp_path):
    models, calib = sources

    def peak(layers: int, run: int) -> int:
        return peak_rss(["convert", "--to", method, str(models[layers]), "-o", str(tmp_path / f"out{layers}-{run}"),
                         "--calib", str(calib), *CALIB, *METHODS[method]])

    assert_flat(peak, DEPTHS, layer_fp32_bytes(models[2]), runs=1)
