"""Checkpoint I/O: model resolution, a lazy safetensors reader, a sharded writer, atomic output folders."""

from attnkit.io.checkpoint import LazyCheckpoint, ShardedWriter, atomic_output_dir
from attnkit.io.resolve import resolve_model

__all__ = ["LazyCheckpoint", "ShardedWriter", "atomic_output_dir", "resolve_model"]
