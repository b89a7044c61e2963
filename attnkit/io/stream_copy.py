"""Copy large unchanged tensors (embeddings, LM head) into their own safetensors file a chunk of
rows at a time, so a 128k x 2048 table never sits in memory whole, and merge them into the
index that `ShardedWriter` wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from attnkit.io.tensor_rows import read_rows, tensor_rows
from attnkit.io.checkpoint import INDEX_FILE, SINGLE_FILE, safetensors_header, tensor_bytes


def stream_tensors(ckpt, items: list[tuple[str, str, float]], path: Path, dtype: torch.dtype,
                   chunk: int = 8192) -> list[str]:
    """Write [(out_name, source_name, scale)] 2-D tensors to one safetensors file at `path`, each
    multiplied by its scale (in fp32; 1.0 copies) and converted to dtype."""
    entries = []
    for out_name, name, _ in items:
        cols = read_rows(ckpt.folder / ckpt.weight_map[name], name, 0, 1).shape[1]
        entries.append((out_name, dtype, [tensor_rows(ckpt, name), cols]))
    with open(path, "wb") as f:
        f.write(safetensors_header(entries))
        for (_, name, scale), (_, _, (rows, _)) in zip(items, entries):
            src = ckpt.folder / ckpt.weight_map[name]
            for lo in range(0, rows, chunk):
                block = read_rows(src, name, lo, min(rows, lo + chunk))
                f.write(tensor_bytes((block if scale == 1.0 else block.float() * scale).to(dtype)))
    return [out for out, _, _ in items]


def merge_index(folder: Path, extra_file: str, extra_names: list[str]) -> None:
    """Make `folder` a sharded checkpoint whose index also lists `extra_names` in `extra_file`."""
    from safetensors import safe_open

    index_path = folder / INDEX_FILE
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        os.replace(folder / SINGLE_FILE, folder / "model-layers.safetensors")
        with safe_open(str(folder / "model-layers.safetensors"), framework="pt") as h:
            index = {"metadata": {}, "weight_map": {k: "model-layers.safetensors" for k in h.keys()}}
    index["weight_map"].update({name: extra_file for name in extra_names})
    total = sum((folder / f).stat().st_size for f in set(index["weight_map"].values()))
    index["metadata"]["total_size"] = total
    index_path.write_text(json.dumps(index, indent=2))
