"""Peak memory against depth, judged by slope: a conversion that streams holds about one layer whatever
the depth; one that keeps every layer grows by a whole layer per layer. One peak is one noisy sample of
RSS (heap reuse, page faults; two runs of the same conversion have differed by 38 MB), so each depth is
the lower of a few runs, the slope is fitted through several depths, and a miss is measured once more
before it is judged."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def slope(peaks: dict[int, int]) -> float:
    """Least-squares bytes per layer through (layers, peak) points."""
    xs, ys = list(peaks), list(peaks.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def assert_flat(peak: Callable[[int, int], int], depths: Sequence[int], layer_bytes: int,
                runs: int = 2, bound: float = 0.5) -> None:
    """`peak(layers, run)`'s slope over `depths` is under `bound` of a layer's bytes per layer: each depth's
    peak the lowest of `runs` runs, and of one more run each before a miss is judged."""
    peaks = {n: min(peak(n, r) for r in range(runs)) for n in depths}
    if slope(peaks) >= bound * layer_bytes:
        peaks = {n: min(peaks[n], peak(n, runs)) for n in depths}
    assert slope(peaks) < bound * layer_bytes, (peaks, layer_bytes)


def layer_fp32_bytes(folder) -> int:
    """The fp32 bytes of the first decoder layer of the checkpoint in `folder`."""
    from attnkit.io.checkpoint import LazyCheckpoint

    ck = LazyCheckpoint(folder)
    return sum(ck.get(n).numel() * 4 for n in ck.keys() if n.startswith("model.layers.0."))


def peak_rss(argv: list[str]) -> int:
    """The peak RSS in bytes of `attnkit ARGV` in a fresh process, which must succeed."""
    from attnkit.evaluation.peak import run_with_peak

    code, peak, err = run_with_peak(argv, env={"TQDM_DISABLE": "1"})
    assert code == 0 and peak > 0, err
    return peak
