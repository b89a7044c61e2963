"""Text sources for pretraining, calibration and fine-tuning.

A *source spec* is one string, the same wherever attnkit takes text (`--calib`, recipes):

* ``python``         the Python source files of the standard library (every machine with Python has it)
* ``python+site``    the same plus the installed site-packages
* ``PATH``           a .txt / .py file (one document), a .jsonl file (a ``text`` field per line),
                     or a folder of such files
* ``hf:NAME[:CONFIG][:SPLIT]``   a Hugging Face dataset's ``text`` column (needs the Hub)

Documents are split train/validation by a hash of their id (relative path, plus the line
number for JSONL), so the split is deterministic and independent of file order or machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from attnkit.errors import AttnkitError

VALIDATION_PERCENT = 5
SPLITS = ("train", "validation", "all")
TEXT_SUFFIXES = (".txt", ".py", ".md", ".jsonl")
_MAX_FILE_BYTES = 2_000_000  # generated tables and data dumps are not useful text


@dataclass(frozen=True)
class Document:
    id: str
    text: str | None  # None: not read yet (a lazily listed file, see `read`)
    path: Path | None = None

    def read(self) -> str:
        """The text, read from `path` now if it was listed lazily ("" for a file too large to use)."""
        if self.text is not None:
            return self.text
        if self.path is None or self.path.stat().st_size > _MAX_FILE_BYTES:
            return ""
        return self.path.read_text(encoding="utf-8", errors="replace")


def split_of(doc_id: str) -> str:
    """Deterministic split by content-independent id: about VALIDATION_PERCENT % go to validation."""
    bucket = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:4], "big") % 100
    return "validation" if bucket < VALIDATION_PERCENT else "train"


def iter_documents(source: str = "python", split: str = "train", lazy: bool = False) -> Iterator[Document]:
    """Yield the documents of `source` that fall into `split` (train / validation / all).

    `lazy`: plain files are listed, not read (`Document.read` reads one; empty ones are then the
    caller's to skip), so a caller that needs a few documents of a large tree reads only those."""
    if split not in SPLITS:
        raise AttnkitError(f"unknown split {split!r} (expected one of {', '.join(SPLITS)})")
    for doc in _iter_all(source, lazy):
        if split == "all" or split_of(doc.id) == split:
            yield doc


def _iter_all(source: str, lazy: bool = False) -> Iterator[Document]:
    if source in ("python", "python+site"):
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        yield from _iter_tree(stdlib, "stdlib/", {"site-packages", "dist-packages", "__pycache__"}, lazy=lazy)
        if source == "python+site":
            site = Path(sysconfig.get_paths()["purelib"])
            yield from _iter_tree(site, "site/", {"__pycache__"}, lazy=lazy)
    elif source.startswith("hf:"):
        yield from _iter_hf(source)
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            yield from _iter_tree(path, "", {"__pycache__", ".git"}, TEXT_SUFFIXES, lazy)
        elif path.is_file():
            yield from _iter_file(path, path.name)
        else:
            raise AttnkitError(
                f"text source {source!r} is not python, python+site, hf:NAME, or an existing file/folder"
            )


def _iter_tree(root: Path, prefix: str, skip_dirs: set[str], suffixes=(".py",), lazy: bool = False) -> Iterator[Document]:
    for path in _listed(root, skip_dirs, suffixes):
        if not path.is_file():
            continue
        doc_id = prefix + path.relative_to(root).as_posix()
        if lazy and path.suffix != ".jsonl":  # a JSONL file's document ids need its lines
            yield Document(doc_id, None, path)
        else:
            yield from _iter_file(path, doc_id)


def _listed(root: Path, skip_dirs: set[str], suffixes) -> list[Path]:
    """The tree's files with one of `suffixes`, sorted, skipping `skip_dirs` without descending into
    them (a `rglob("*")` listed every file of the standard library first: 0.7 s of CPU per call)."""
    files = []
    for folder, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if d not in skip_dirs]
        files.extend(Path(folder) / n for n in names if os.path.splitext(n)[1] in suffixes and n not in skip_dirs)
    return sorted(files)


def _iter_file(path: Path, doc_id: str) -> Iterator[Document]:
    if path.stat().st_size > _MAX_FILE_BYTES:
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".jsonl":
        for lineno, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise AttnkitError(f"{path}:{lineno + 1} is not valid JSON") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise AttnkitError(f"{path}:{lineno + 1} has no string field 'text'")
            yield Document(f"{doc_id}#{lineno}", record["text"])
    elif text.strip():
        yield Document(doc_id, text)


def _iter_hf(source: str) -> Iterator[Document]:
    parts = source[3:].split(":")
    name, config = parts[0], (parts[1] or None) if len(parts) > 1 else None
    split = parts[2] if len(parts) > 2 else "train"
    try:
        import datasets

        dataset = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as exc:  # offline, unknown name, gated …
        raise AttnkitError(f"cannot load dataset {name!r}: {str(exc).splitlines()[0]}") from None
    for i, record in enumerate(dataset):
        text = record.get("text")
        if isinstance(text, str) and text.strip():
            yield Document(f"{name}#{i}", text)


def shuffled(docs: list[Document], seed: int) -> list[Document]:
    """A seed-determined order that does not depend on the order the documents were read in."""
    key = lambda d: hashlib.sha256(f"{seed}:{d.id}".encode()).digest()  # noqa: E731
    return sorted(docs, key=key)


def pack_tokens(
    tokenizer,
    source: str = "python",
    split: str = "train",
    seq_len: int = 512,
    n_tokens: int | None = None,
    seed: int = 0,
    transform: Callable[[str], str] | None = None,
) -> torch.Tensor:
    """Tokenise documents (in a seed-shuffled order), join them with EOS and cut into rows.
    `transform` rewrites each document's text first (training needles: `attnkit.needles`).

    Returns a LongTensor [n_rows, seq_len]; stops once `n_tokens` tokens are collected.
    Raises AttnkitError if the source cannot fill one row.
    """
    eos = tokenizer.eos_token_id
    docs = shuffled(list(iter_documents(source, split, lazy=True)), seed)
    stream: list[int] = []
    wanted = n_tokens if n_tokens is not None else float("inf")
    batch = 8 if n_tokens is not None else 64  # a small batch reads and tokenises little past n_tokens
    for start in range(0, len(docs), batch):
        texts = [t for t in (d.read() for d in docs[start : start + batch]) if t.strip()]
        texts = [transform(t) for t in texts] if transform is not None else texts
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else ():
            stream.extend(ids)
            if eos is not None:
                stream.append(eos)
        if len(stream) >= wanted:
            break
    total = min(len(stream), wanted)
    rows = int(total) // seq_len
    if rows == 0:
        raise AttnkitError(
            f"text source {source!r} ({split}) has {len(stream)} tokens, fewer than one sequence of {seq_len}"
        )
    return torch.tensor(stream[: rows * seq_len], dtype=torch.long).view(rows, seq_len)
