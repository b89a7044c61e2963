"""Streaming safetensors I/O.

A converter reads one tensor at a time (`LazyCheckpoint`) and writes shards as it goes
(`ShardedWriter`), so converting a model needs the memory of about one layer, not the model.
Output goes to a temporary sibling folder that is renamed into place only when complete
(`atomic_output_dir`), so an interrupted run never leaves a half-written checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from attnkit.errors import AttnkitError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class LazyCheckpoint:
    """Name → tensor access over a single-file or sharded safetensors checkpoint.

    Each `get` opens the shard, reads one tensor and closes the handle again, so resident
    memory stays at the tensors the caller holds.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        single = self.folder / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise AttnkitError(f"{index} is not a valid safetensors index ({exc})") from None
            self.weight_map: dict[str, str] = dict(weight_map)
        elif single.is_file():
            self.weight_map = {name: SINGLE_FILE for name in keys_of(single)}
        else:
            raise AttnkitError(f"no safetensors weights in {self.folder} (expected {SINGLE_FILE} or {INDEX_FILE})")
        for shard in sorted(set(self.weight_map.values())):
            if not (self.folder / shard).is_file():
                raise AttnkitError(f"shard {shard} listed in the index is missing from {self.folder}")

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        if name not in self.weight_map:
            raise AttnkitError(f"tensor {name!r} not found in {self.folder}")
        path = self.folder / self.weight_map[name]
        try:
            with safe_open(path, framework="pt", device="cpu") as handle:
                tensor = handle.get_tensor(name)
        except Exception as exc:  # safetensors raises several types for corrupt files
            raise AttnkitError(f"cannot read {name!r} from {path.name}: {exc}") from None
        if dtype is not None:
            tensor = tensor.to(dtype)
        return tensor.to(device)

    def total_bytes(self) -> int:
        return sum((self.folder / shard).stat().st_size for shard in set(self.weight_map.values()))

    def header(self) -> dict[str, dict]:
        """name -> {"dtype": "BF16", "shape": [..]} from the shards' safetensors headers: what a
        check needs about every tensor, without reading any tensor data."""
        merged: dict[str, dict] = {}
        for shard in sorted(set(self.weight_map.values())):
            merged.update(read_header(self.folder / shard))
        missing = [name for name in self.weight_map if name not in merged]
        if missing:
            raise AttnkitError(f"tensor {missing[0]!r} is listed in the index of {self.folder} but not in its shard")
        return {name: merged[name] for name in self.weight_map}

    def storage_dtype(self, name: str | None = None) -> torch.dtype:
        """The dtype the weights (or the tensor `name`) are stored in, bf16 / fp16, else fp32 (what a
        16-bit-aware computation rounds to); from the shard's header, no tensor data is read."""
        name = name or next(n for n in self.keys() if n.endswith("norm.weight") or n.endswith("proj.weight"))
        stored = FLOAT_DTYPES.get(read_header(self.folder / self.weight_map[name])[name]["dtype"])
        return stored if stored in (torch.bfloat16, torch.float16) else torch.float32

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """name -> shape, from the headers only."""
        return {name: tuple(h["shape"]) for name, h in self.header().items()}


FINITE_CHUNK = 1 << 22  # elements checked at once: a bounded temporary whatever the tensor's size


FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def first_non_finite(folder: str | os.PathLike) -> tuple[str, str] | None:
    """(tensor name, "NaN" or "Inf") of the first floating-point tensor that holds a NaN or an infinity,
    None when every one is finite. Read with plain file I/O a chunk at a time (not mmap, whose touched
    pages would stay resident: the whole checkpoint's bytes, at the peak of a streamed conversion)."""
    ckpt = LazyCheckpoint(folder)
    for shard in dict.fromkeys(ckpt.weight_map.values()):
        path = ckpt.folder / shard
        header = read_header(path)
        try:
            with open(path, "rb") as f:
                base = 8 + int.from_bytes(f.read(8), "little")
                for name, entry in header.items():
                    dtype = FLOAT_DTYPES.get(entry.get("dtype"))
                    if dtype is not None and (bad := _non_finite_in(f, base, entry["data_offsets"], dtype)):
                        return name, bad
        except OSError as exc:
            raise AttnkitError(f"cannot read the weights in {path}: {exc}") from None
    return None


def _non_finite_in(f, base: int, offsets: list[int], dtype: torch.dtype) -> str | None:
    """"NaN", "Inf" or None for the tensor at `offsets` of an open safetensors file (data from `base`)."""
    lo, hi = (base + int(o) for o in offsets)
    step = FINITE_CHUNK * dtype.itemsize
    buffer = bytearray(min(step, hi - lo))
    f.seek(lo)
    for start in range(lo, hi, step):
        got = f.readinto(memoryview(buffer)[: min(step, hi - start)])
        chunk = torch.frombuffer(buffer, dtype=dtype, count=got // dtype.itemsize)
        if not bool(torch.isfinite(chunk).all()):
            return "NaN" if bool(torch.isnan(chunk).any()) else "Inf"
    return None


def check_finite(folder: str | os.PathLike, what: str | None = None) -> None:
    """Refuse a checkpoint with a NaN or infinite weight in one line naming the first such tensor
    (`what`: how the message names the model, default the folder): a conversion of it fails midway
    and an evaluation of it gives a perplexity of nan beside accuracies that look normal."""
    bad = first_non_finite(folder)
    if bad is not None:
        raise AttnkitError(f"{what or folder} has non-finite weights: tensor {bad[0]!r} holds {bad[1]} values; "
                           "it cannot be converted, evaluated or published (re-export it from a good checkpoint)")


def keys_of(path: Path) -> list[str]:
    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            return list(handle.keys())
    except Exception as exc:
        raise AttnkitError(f"{path} is not a readable safetensors file ({exc})") from None


MAX_HEADER = 100 * 1024**2  # safetensors' own limit on the JSON header


def read_header(path: Path) -> dict[str, dict]:
    """The JSON header of one safetensors file (name -> dtype, shape, data_offsets), `__metadata__` left out."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= MAX_HEADER:
                raise ValueError(f"header length {size}")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (OSError, ValueError) as exc:
        raise AttnkitError(f"{path} is not a readable safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    return header


ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}


def safetensors_header(entries: list[tuple[str, torch.dtype, list[int]]]) -> bytes:
    """The length-prefixed JSON header of a safetensors file whose tensors follow back to back
    in `entries` order (safetensors requires contiguous offsets; the header is padded to 8 bytes)."""
    header, offset = {}, 0
    for name, dtype, shape in entries:
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy when it is contiguous."""
    return memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


class ShardedWriter:
    """Writes tensors to disk as they arrive and closes a shard whenever `max_shard_bytes` is reached.

    Nothing is buffered in memory: each tensor's bytes go to a scratch file per dtype at once; a
    shard is assembled from them (header first, wider dtypes first for alignment) when it closes.
    Call `close()` at the end: it writes the last shard and the index (or renames a lone shard to
    `model.safetensors`, the name transformers expects for unsharded weights).
    """

    def __init__(self, folder: str | os.PathLike, max_shard_bytes: int = 2 * 1024**3):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._entries: dict[torch.dtype, list[tuple[str, torch.dtype, list[int]]]] = {}
        self._scratch: dict[torch.dtype, object] = {}
        self._pending_bytes = 0
        self._names: set[str] = set()
        self._shards: list[tuple[str, list[str]]] = []
        self._total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._entries and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        if tensor.dtype not in self._scratch:
            self._scratch[tensor.dtype] = open(self._scratch_path(tensor.dtype), "wb")
            self._entries[tensor.dtype] = []
        self._scratch[tensor.dtype].write(tensor_bytes(tensor))
        self._entries[tensor.dtype].append((name, tensor.dtype, list(tensor.shape)))
        self._names.add(name)
        self._pending_bytes += nbytes
        self._total += nbytes

    def _scratch_path(self, dtype: torch.dtype) -> Path:
        return self.folder / f".shard-{len(self._shards):05d}-{ST_DTYPES[dtype]}.part"

    def _flush(self) -> None:
        if not self._entries:
            return
        shard = f"shard-{len(self._shards):05d}.safetensors"
        order = sorted(self._entries, key=lambda dt: -dt.itemsize)
        entries = [e for dt in order for e in self._entries[dt]]
        with open(self.folder / shard, "wb") as out:
            out.write(safetensors_header(entries))
            for dt in order:
                self._scratch[dt].close()
                path = self._scratch_path(dt)
                with open(path, "rb") as part:
                    shutil.copyfileobj(part, out, 1 << 24)
                path.unlink()
        self._shards.append((shard, [name for name, _, _ in entries]))
        self._entries, self._scratch, self._pending_bytes = {}, {}, 0

    def close(self) -> None:
        self._flush()
        if len(self._shards) == 1:
            os.replace(self.folder / self._shards[0][0], self.folder / SINGLE_FILE)
            return
        count = len(self._shards)
        weight_map = {}
        for i, (old, names) in enumerate(self._shards):
            new = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.folder / old, self.folder / new)
            weight_map.update({name: new for name in names})
        index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2))


def weights_fingerprint(folder: Path) -> str | None:
    """sha256 of the index file, or of a single file's safetensors header (names, dtypes, shapes,
    offsets): identifies a checkpoint's weights without reading them."""
    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        return hashlib.sha256((folder / INDEX_FILE).read_bytes()).hexdigest()
    if not (folder / SINGLE_FILE).is_file():
        return None
    with open(folder / SINGLE_FILE, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return hashlib.sha256(f.read(n)).hexdigest()


def check_output_dir(out: str | os.PathLike, force: bool = False, sources: tuple = (),
                     what: str = "the source model") -> Path:
    """Refuse an OUT that is, is inside or contains a source folder (whatever the flags: --force
    would delete the source), a non-empty OUT unless forced, and an OUT that is a file. `what`
    names the sources in the message (a teacher, a run folder)."""
    out = Path(out)
    target = out.resolve()
    for src in sources:
        src = Path(src).resolve()
        if target == src or src in target.parents or target in src.parents:
            how = "is" if target == src else "is inside" if src in target.parents else "contains"
            raise AttnkitError(f"output folder {out} {how} {what} {src}; write somewhere else")
    if out.exists() and not out.is_dir():
        raise AttnkitError(f"output path {out} exists and is not a folder")
    check_not_claimed(out)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise AttnkitError(f"output folder {out} is not empty (use --force to replace it)")
    return out


def check_can_write(path: str | os.PathLike, what: str = "--out") -> None:
    """Refuse a file path that cannot be written, before any work: a file where a folder on its way must
    be, or a nearest existing folder that is not writable (what is missing would be created there)."""
    folder = Path(os.path.abspath(Path(path).expanduser())).parent
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    if not folder.is_dir():
        raise AttnkitError(f"{what} {path} cannot be written: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise AttnkitError(f"{what} {path} cannot be written: the folder {folder} is not writable")


def check_results_file(out: Path, schema: str, command: str) -> None:
    """Refuse an --out FILE that exists and is not an earlier `attnkit COMMAND` result (its `schema`):
    a model's config.json or weights given by mistake would otherwise be overwritten."""
    if not out.is_file():
        return
    try:
        ours = json.loads(out.read_text(encoding="utf-8")).get("schema") == schema
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        ours = False
    if not ours:
        raise AttnkitError(f"--out {out} exists and is not an `attnkit {command}` results file; give a new file name")


TMP_MARK = ".attnkit-tmp-"  # .OUT.attnkit-tmp-PID-XXXXXXXX: the scratch folder of a run writing OUT


def remove_stale_tmp(parent: Path) -> list[Path]:
    """Remove attnkit scratch folders and output locks in `parent` left by processes that are gone
    (killed runs)."""
    removed = []
    for folder in parent.glob(f".*{TMP_MARK}*") if parent.is_dir() else []:
        pid = folder.name.rsplit(TMP_MARK, 1)[1].split("-")[0]
        if folder.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    for lock in parent.glob(f".*{LOCK_MARK}") if parent.is_dir() else []:
        if str(lock) not in _claims and _remove_if_free(lock):
            removed.append(lock)
    return removed


def _remove_if_free(lock: Path) -> bool:
    """Unlink a lock file no process holds (its writer was killed: the kernel freed the lock, the file
    stayed). Taken first, so a live holder is never touched; a claimer that opened the old file meanwhile
    sees it replaced and locks the new one (`_acquire`)."""
    try:
        import fcntl

        fd = os.open(lock, os.O_RDONLY)
    except (ImportError, OSError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.unlink()
        return True
    except OSError:  # held (BlockingIOError), gone already, or no locks here
        return False
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, force: bool = False, sources: tuple = ()) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `out`, on any failure it is removed.

    The reports in it are made public before the rename (`publish_reports`: no absolute local paths).
    `out` is claimed for the whole time (`claim_output`): a second attnkit process writing the same
    folder is refused in one line, and an `out` that appeared meanwhile some other way is not replaced
    unless `force` (the first result stays; this run's is discarded with a one-line error).
    SIGTERM is turned into an exception for the duration so a `kill` cleans up like Ctrl-C; what a
    SIGKILLed run left (its pid is in the folder's name) is removed by the next run into `out`'s parent.
    """
    out = check_output_dir(out, force, sources).absolute()
    with claim_output(out):
        check_output_dir(out, force, sources)  # again: another run may have finished writing it just before the claim
        tmp = _new_tmp(out)
        previous = _install_sigterm()
        try:
            yield tmp
            from attnkit.io.public import publish_reports

            if not any(TMP_MARK in part for part in out.parts):  # an intermediate in a scratch folder keeps its paths
                publish_reports(tmp, out)  # no absolute path of this machine in the reports (after the card was written)
            if out.exists() or out.is_symlink():
                if not force and (not out.is_dir() or any(out.iterdir())):
                    raise AttnkitError(f"output folder {out} appeared while this run was writing it; it was left as it "
                                       "is and this run's result discarded (use --force to replace it)")
                if out.is_dir() and not out.is_symlink():
                    shutil.rmtree(out)
                else:
                    out.unlink()
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            _restore_sigterm(previous)


LOCK_MARK = ".attnkit-lock"  # .OUT.attnkit-lock beside OUT: locked by the process writing OUT, holds its pid
_claims: dict[str, list] = {}  # lock path -> [fd or None, depth]: the claims this process holds


def lock_path(out: str | os.PathLike) -> Path:
    """`.OUT.attnkit-lock` beside `out`; `out/`, `./out` and a path through a symlinked parent give the same file."""
    out = Path(os.path.abspath(Path(out).expanduser()))  # normalises `out/`, `./out`, `a/../out`
    return Path(os.path.realpath(out.parent)) / f".{out.name}{LOCK_MARK}"


def _lock_holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        pid = ""
    return pid if pid.isdigit() else "unknown"


def check_not_claimed(out: str | os.PathLike) -> None:
    """Refuse an `out` that another attnkit process is writing now (it holds `out`'s lock): cheap, so
    commands call it before their expensive work, long before their own claim."""
    lock = lock_path(out)
    if str(lock) in _claims or not lock.is_file():
        return
    try:
        import fcntl

        fd = os.open(lock, os.O_RDONLY)
    except (ImportError, OSError):
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise AttnkitError(f"{out} is being written by another attnkit process (pid {_lock_holder(fd)}); wait for it "
                           "to finish or write somewhere else") from None
    except OSError:
        pass
    finally:
        os.close(fd)  # releases the shared lock taken only to test


def _make_parents(folder: Path, out: Path) -> list[Path]:
    """Create `folder` and its missing parents; returns those created (removed again if the run fails)."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        if folder.parent == folder:
            break
        folder = folder.parent
    if not folder.is_dir():
        raise AttnkitError(f"cannot write {out}: {folder} is a file, not a folder")
    for f in reversed(missing):
        try:
            f.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise AttnkitError(f"cannot write {out}: cannot create the folder {f} ({exc.strerror or exc})") from None
    return missing


@contextlib.contextmanager
def claim_output(out: str | os.PathLike) -> Iterator[Path]:
    """Hold `out` for this process while the block runs: an exclusive lock on `.OUT.attnkit-lock` beside it
    (created if needed, with this pid in it; removed at the end). Another attnkit process claiming the same
    `out` meanwhile is refused in one line naming this pid. The lock is the kernel's (`flock`): a killed
    run's lock is free at once, whatever its file says. Re-entrant within a process. Missing parent
    folders are created (and removed again if nothing was written into them); an unwritable parent is a
    one-line error. Where the file system cannot lock (no `fcntl`), the block runs unclaimed."""
    out = Path(out)
    lock = lock_path(out)
    key = str(lock)
    if key in _claims:
        _claims[key][1] += 1
        try:
            yield lock
        finally:
            _claims[key][1] -= 1
        return
    created = _make_parents(lock.parent, out)
    fd = _acquire(lock, out)
    _claims[key] = [fd, 1]
    try:
        yield lock
    finally:
        del _claims[key]
        if fd is not None:
            with contextlib.suppress(OSError):
                lock.unlink()
            os.close(fd)
        for folder in created:  # innermost first; stops at the first one something was written into
            try:
                folder.rmdir()
            except OSError:
                break


def _acquire(lock: Path, out: Path) -> int | None:
    try:
        import fcntl
    except ImportError:
        return None
    for _ in range(100):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise AttnkitError(f"cannot write {out}: its folder {lock.parent} is not writable "
                               f"({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise AttnkitError(f"{out} is being written by another attnkit process (pid {holder}); wait for it to "
                               "finish or write somewhere else") from None
        except OSError:  # a file system without locks: run unclaimed
            os.close(fd)
            return None
        try:  # the holder may have released (and removed) the file between our open and lock: lock the new one
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)
    raise AttnkitError(f"cannot claim {out}: its lock file {lock} keeps changing")


def _new_tmp(out: Path) -> Path:
    """Create `.OUT.attnkit-tmp-PID-XXXXXXXX` beside `out`, after removing what dead runs left there."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(out.parent)
    tmp = out.parent / f".{out.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


@contextlib.contextmanager
def scratch_dir(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a scratch folder beside `out` (intermediate results of a run writing `out`), removed at the end.

    Named like `atomic_output_dir`'s folder, pid included, so that what a SIGKILLed run left is removed
    by the next run into the same parent (`remove_stale_tmp`); a `tempfile` name would stay forever.
    """
    tmp = _new_tmp(Path(out).absolute())
    previous = _install_sigterm()
    try:
        yield tmp
    finally:
        _restore_sigterm(previous)
        shutil.rmtree(tmp, ignore_errors=True)


def _raise_interrupt(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"terminated by signal {signum}")


def _install_sigterm():
    try:
        return signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:  # not the main thread
        return None


def _restore_sigterm(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
