"""Memory bandwidth from a plain copy: the yardstick for memory-bound decoding.

Decoding one token must read the whole KV cache at least once, so `cache bytes ÷ bandwidth` is a lower
bound on the attention time of a step. A copy of N bytes moves 2·N bytes (read + write); we report that
traffic per second, the same accounting as STREAM's "Copy".
"""

from __future__ import annotations

import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: str | torch.device = "cpu", megabytes: int = 256, repeats: int = 5,
                   clock=time.perf_counter) -> dict:
    """Median read+write bytes/s of `dst.copy_(src)` over `repeats` copies of `megabytes` MB (fp32).

    The buffer is far larger than any cache level, so this is DRAM (or HBM) bandwidth. `clock` may be
    `time.process_time` to measure per CPU-second on a shared machine (as `attnkit bench --clock cpu`).
    """
    device = torch.device(device)
    n = megabytes * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch pages / warm up
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = clock()
        dst.copy_(src)
        _sync(device)
        times.append(clock() - t0)
    moved = 2 * n * 4
    rates = sorted(moved / t for t in times)
    return {
        "bytes_per_s": statistics.median(rates),
        "min_bytes_per_s": rates[0],
        "max_bytes_per_s": rates[-1],
        "buffer_mb": megabytes,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "device": str(device),
    }
