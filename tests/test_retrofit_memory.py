"""Every method streams: its peak memory does not grow with the number of layers.

`diff` and `mla+titans` share every streamed pass with `dex` and `mla+dex` (only the modules installed
per layer differ), so they are left out to keep the suite's time.

Each `--to` runs in a subprocess on a 2-layer and a 10-layer model of the same width; the peak RSS
of the deeper one may exceed the shallower one's by less than three layers' fp32 weights (45 MB).
Loading the whole model, as the retrofits did before they streamed, added 183 MB from 2 to 10
layers for `--to dex` (503 -> 686 MB; streamed: 473 -> 481 MB), so this cannot pass by noise; a peak is one noisy sample (heap reuse,
page faults), so a pair that misses the bound is measured once more and the lower peaks kept.
"""

import sys
from pathlib import Path

import pytest

from attnkit.evaluation.peak import run_with_peak
from attnkit.io.checkpoint import LazyCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from mla_fixtures import calib_folder, save_model  # noqa: E402

WIDE = dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=1024)
CALIB = ["--calib-tokens", "1024", "--calib-seq-len", "128"]
METHODS = {
    "dex": ["--heads", "auto"],
    "titans": ["--window", "64"],
    "gqa": ["--kv-heads", "1"],
    "mla+dex": ["--kv-lora-rank", "64", "--rope-dim", "32", "--eval-tokens", "512"],
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrofit-memory")
    return {layers: save_model(root / f"src{layers}", "llama", num_hidden_layers=layers, **WIDE) for layers in (2, 10)}, \
        calib_folder(root / "calib")


def _peak(method: str, src: Path, calib: Path, out: Path) -> int:
    code, peak, err = run_with_peak(["convert", "--to", method, str(src), "-o", str(out), "--calib", str(calib),
                                     *CALIB, *METHODS[method]], env={"TQDM_DISABLE": "1"})
    assert code == 0 and peak > 0, err
    return peak


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_peak_memory_does_not_grow_with_layers(sources, method, tmp_path):
    models, calib = sources
    ck = LazyCheckpoint(models[2])
    layer_bytes = sum(ck.get(n).numel() * 4 for n in ck.keys() if n.startswith("model.layers.0."))
    peaks = {n: _peak(method, models[n], calib, tmp_path / f"a{n}") for n in models}
    if peaks[10] - peaks[2] >= 3 * layer_bytes:  # a second sample of each before judging
        peaks = {n: min(peaks[n], _peak(method, models[n], calib, tmp_path / f"b{n}")) for n in models}
    assert peaks[10] - peaks[2] < 3 * layer_bytes, (peaks, layer_bytes)
