"""Teacher log-probs precomputed to disk once, so that training runs without the teacher model.

Layout of `teacher_cache.dir` (written to a temporary sibling and renamed when complete):

  manifest.json                  fingerprint (what the targets depend on), shard list, format
  shard-00000.safetensors        rows   int64 [n]          packed-row index of each stored row
                                 logprobs bf16/fp16/fp32 [n, L, k or V]  log softmax(teacher / T)
                                 ids    int32 [n, L, k]     (top-k only) their token ids
                                 rest   fp32  [n, L]        (top-k only) log of the mass outside top-k

Targets are keyed by *packed-row index* (the row of `batches.load_train_rows`), not by step: every
epoch's permutation, every process count and a resume read the same rows by index. A cache whose
fingerprint differs from the run's (teacher weights, tokenizer, data rows, seq_len, T, top_k,
dtype) is refused with one line, or rebuilt when `teacher_cache.rebuild: true`.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import atomic_output_dir
from attnkit.training.losses import TeacherTargets, topk_targets

MANIFEST = "manifest.json"
FORMAT = "attnkit-teacher-cache/1"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SAMPLE = 4 << 20  # bytes hashed at each end of a weight file (the safetensors header is at the start)


# ------------------------------------------------------------------ fingerprint


def weights_digest(model_dir: Path) -> dict:
    """Size and a sampled sha256 (first and last 4 MiB + size) of each weight file, plus config.json.

    Sampling keeps this instant for 100 GB checkpoints; a re-trained teacher changes the header's
    offsets or the sampled bytes in practice, and its size or config otherwise.
    """
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    out = {}
    for path in [model_dir / "config.json", *files]:
        if not path.is_file():
            continue
        size = path.stat().st_size
        h = hashlib.sha256(str(size).encode())
        with path.open("rb") as f:
            h.update(f.read(_SAMPLE))
            if size > 2 * _SAMPLE:
                f.seek(size - _SAMPLE)
                h.update(f.read(_SAMPLE))
            elif size > _SAMPLE:
                h.update(f.read())
        out[path.name] = {"bytes": size, "sha256_sampled": h.hexdigest()[:32]}
    return out


def tokenizer_digest(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    payload = json.dumps([vocab, tokenizer.eos_token_id, tokenizer.bos_token_id])
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def rows_digest(rows: torch.Tensor) -> str:
    """sha256 of the token ids of `rows` [n, L] (int64, in order)."""
    return hashlib.sha256(rows.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:32]


def fingerprint(teacher_path: Path, tokenizer, vocab: int, data, rows: torch.Tensor, used: list[int],
                temperature: float, top_k: int | None, dtype: str) -> dict:
    """Everything the cached targets depend on; a cache is used only under an identical one.

    `vocab` is the logits width; top_k ≥ vocab is the full distribution (stored as top_k null).
    """
    return {
        "teacher": str(teacher_path.resolve()),
        "teacher_weights": weights_digest(teacher_path),
        "tokenizer": tokenizer_digest(tokenizer),
        "data_source": data.source,
        "data_seed": data.seed,
        "seq_len": int(rows.shape[1]),
        "rows": len(used),
        "rows_sha256": rows_digest(rows[used]),
        "temperature": float(temperature),
        "top_k": None if top_k is None or top_k >= vocab else int(top_k),
        "dtype": dtype,
    }


# ------------------------------------------------------------------ state of the folder


def read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError:
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def plan(folder: Path, fp: dict, rebuild: bool) -> str:
    """'use' a matching cache, 'build' into an absent/empty folder or (rebuild) over a stale cache.

    Refuses, with one line and nothing touched, a stale cache without `rebuild` and a non-empty
    folder that is not a teacher cache.
    """
    if folder.exists() and not folder.is_dir():
        raise AttnkitError(f"recipe key teacher_cache.dir: {folder} exists and is not a folder")
    if not folder.exists() or not any(folder.iterdir()):
        return "build"
    manifest = read_manifest(folder)
    if manifest is None:
        raise AttnkitError(f"teacher cache {folder} is not empty and holds no {MANIFEST} of a teacher cache; use another dir")
    if manifest.get("fingerprint") == fp:
        return "use"
    if rebuild:
        return "build"
    old = manifest.get("fingerprint") or {}
    differ = sorted(k for k in set(fp) | set(old) if fp.get(k) != old.get(k))
    raise AttnkitError(
        f"teacher cache {folder} was made for another run (differs in: {', '.join(differ)}); "
        "set teacher_cache.rebuild=true to rebuild it, or use another teacher_cache.dir"
    )


# ------------------------------------------------------------------ building


def build(folder: Path, teacher, rows: torch.Tensor, used: list[int], fp: dict, *, batch_size: int, device,
          autocast, val: tuple[torch.Tensor, str] | None = None, max_shard_bytes: int = 1 << 30,
          progress: bool = True, chunked: bool = True) -> dict:
    """Run `teacher` once over rows[used] [n, L] and write the cache atomically; returns the manifest.

    `autocast` is a context factory (accelerator.autocast) so the targets match an in-process teacher
    run under the same mixed precision. `val` = (validation rows, their digest): the teacher's
    validation loss is stored too, so a run from the cache still reports the target it heals toward;
    `chunked` (`train.chunked_head`): measured over the LM head in chunks, as an in-process teacher's is.
    """
    from tqdm.auto import tqdm

    from attnkit.training import chunked_head
    from attnkit.training.measure import validation_loss

    dtype, top_k = DTYPES[fp["dtype"]], fp["top_k"]
    seq_len = rows.shape[1]
    width = teacher.config.vocab_size if top_k is None else top_k
    per_row = seq_len * width * (dtype.itemsize + (0 if top_k is None else 4)) + (0 if top_k is None else 4 * seq_len)
    rows_per_shard = max(1, min(len(used), max_shard_bytes // per_row))
    shards, pending = [], []
    bar = tqdm(total=len(used), desc="teacher cache", unit="row", disable=not progress, dynamic_ncols=True)
    with atomic_output_dir(folder, force=True) as tmp:
        for start in range(0, len(used), batch_size):
            index = torch.tensor(used[start : start + batch_size], dtype=torch.int64)
            batch = rows[index].to(device)  # [b, L]
            with torch.no_grad(), autocast():
                logits = teacher(input_ids=batch, use_cache=False).logits  # [b, L, V]
            t = topk_targets(logits, fp["temperature"], top_k)
            pending.append((index, t.to("cpu")))
            if sum(len(i) for i, _ in pending) >= rows_per_shard:
                shards.append(_write_shard(tmp, len(shards), pending, dtype))
                pending = []
            bar.update(len(index))
        if pending:
            shards.append(_write_shard(tmp, len(shards), pending, dtype))
        bar.close()
        manifest = {"format": FORMAT, "fingerprint": fp, "shards": shards,
                    "bytes_per_token": per_row / seq_len}
        if val is not None:
            head = chunked_head.checked_head(teacher, device) if chunked else None
            total, count = validation_loss(teacher, val[0], batch_size, device, head=head)
            loss = total / count
            manifest["teacher_validation"] = {
                "val_rows_sha256": val[1],
                "validation": {"loss": round(loss, 5), "token_perplexity": round(math.exp(loss), 4)},
            }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def _write_shard(tmp: Path, number: int, pending: list[tuple[torch.Tensor, TeacherTargets]], dtype) -> dict:
    name = f"shard-{number:05d}.safetensors"
    tensors = {
        "rows": torch.cat([i for i, _ in pending]),
        "logprobs": torch.cat([t.logprobs for _, t in pending]).to(dtype).contiguous(),
    }
    if pending[0][1].ids is not None:
        tensors["ids"] = torch.cat([t.ids for _, t in pending]).to(torch.int32).contiguous()
        tensors["rest"] = torch.cat([t.rest for _, t in pending]).float().contiguous()
    save_file(tensors, str(tmp / name))
    return {"file": name, "rows": tensors["rows"].tolist()}


# ------------------------------------------------------------------ reading


class TeacherCache:
    """Reads the targets of given packed-row indices; each process opens only the slices it asks for."""

    def __init__(self, folder: Path):
        manifest = read_manifest(folder)
        if manifest is None:
            raise AttnkitError(f"teacher cache {folder} has no valid {MANIFEST}")
        self.folder, self.manifest = folder, manifest
        self.where = {row: (shard["file"], j) for shard in manifest["shards"] for j, row in enumerate(shard["rows"])}
        self._open: dict[str, object] = {}

    def teacher_validation(self, val_digest: str) -> dict | None:
        """The teacher's validation loss if it was measured on the same validation rows."""
        stored = self.manifest.get("teacher_validation") or {}
        return {"validation": stored["validation"]} if stored.get("val_rows_sha256") == val_digest else None

    def _file(self, name: str):
        if name not in self._open:
            self._open[name] = safe_open(str(self.folder / name), framework="pt")
        return self._open[name]

    def targets(self, row_index: torch.Tensor) -> TeacherTargets:
        """TeacherTargets for rows [b] (packed-row indices) → logprobs [b, L, k|V] (+ ids, rest)."""
        parts: dict[str, list[torch.Tensor]] = {"logprobs": [], "ids": [], "rest": []}
        for row in row_index.tolist():
            if row not in self.where:
                raise AttnkitError(f"teacher cache {self.folder} has no targets for row {row}; rebuild it")
            name, j = self.where[row]
            f = self._file(name)
            for key in ("logprobs", "ids", "rest") if "ids" in f.keys() else ("logprobs",):
                parts[key].append(f.get_slice(key)[j : j + 1])
        cat = lambda key: torch.cat(parts[key]) if parts[key] else None  # noqa: E731
        return TeacherTargets(cat("logprobs"), cat("ids"), cat("rest"))
