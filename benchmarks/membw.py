"""Copy-benchmark memory bandwidth of this machine (the bound `attnkit bench` compares decode against).

    python benchmarks/membw.py [--device cpu|cuda] [--mb 256] [--threads N]
"""

import argparse
import json

import torch

from attnkit.evaluation.membw import copy_bandwidth


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--mb", type=int, default=256, help="buffer size in MB (well above the last-level cache)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = copy_bandwidth(args.device, args.mb, args.repeats)
    print(json.dumps(result, indent=2))
    print(f"copy bandwidth (read+write): {result['bytes_per_s'] / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
