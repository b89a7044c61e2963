"""Local places in what attnkit writes: reports travel (`attnkit push` uploads them), so no report
carries an absolute path of the machine that wrote it.

A local folder is written relative to the output folder when it lies under the current working
directory (`../src` beside `out/x`: still found when both move together), else by its name only;
a bundled model by its word (`reference`), a model from the Hub cache from its `models--owner--name`
part on (the card still tells it from a local folder); Hub ids and relative names stay as they are.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

REPORT_FILES = ("attnkit_report.json", "finetune_report.json", "eval_results.json")
# (name, folder) pairs in the reports: the name a user gave and the folder it was read from
MODEL_PAIRS = {
    "attnkit_report.json": [(("source",), "model", "path")],
    "finetune_report.json": [((), "base_model", "base_model_path"), ((), "teacher", "teacher_path")],
}
_ABSOLUTE = re.compile(r"^(/|~/|[A-Za-z]:[\\/])[^\s]*$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_absolute(text: Any) -> bool:
    """A string that names a place from the root of this machine (or a home folder): `/data/x`, `~/x`, `C:\\x`."""
    return isinstance(text, str) and len(text) > 1 and bool(_ABSOLUTE.match(text))


def _bundled_name(path: Path) -> str | None:
    from attnkit.io.resolve import ASSETS, BUNDLED

    try:
        if path.name in BUNDLED and path.parent.resolve() == ASSETS.resolve():
            return path.name
    except OSError:
        pass
    return None


def _hub_cache_part(path: Path) -> str | None:
    parts = path.parts
    for i, part in enumerate(parts):
        if part.startswith("models--"):
            return "/".join(parts[i:])
    return None


def public_path(path: str | os.PathLike | None, out_dir: str | os.PathLike | None) -> str | None:
    """`path` as a report may carry it (see the module's docstring); `out_dir` is the folder the report is
    in (None: a local folder by its name only, relative paths as they are)."""
    if path is None:
        return None
    text = os.fspath(path)
    p = Path(text).expanduser()
    if not p.is_absolute() and (out_dir is None or not (text and p.exists())):  # a Hub id, a word, not a place here
        return text
    named = _bundled_name(p) or _hub_cache_part(p)
    if named:
        return named
    resolved = Path(os.path.realpath(p))
    if out_dir is not None:
        try:
            resolved.relative_to(Path(os.path.realpath(Path.cwd())))
        except ValueError:
            pass
        else:
            return Path(os.path.relpath(resolved, os.path.realpath(Path(out_dir).expanduser()))).as_posix()
    return resolved.name or p.name or text


def public_model(name: str | None, path: str | os.PathLike | None, out_dir) -> tuple[str | None, str | None]:
    """(the name a user gave a model, the folder it was read from) as a report carries them. A local
    folder's name is made public too when absolute, and marked local (`./out/x`) when it has the shape
    of a Hub id, so that whoever reads the report later (the card, from any folder) does not take it
    for one."""
    public = public_path(path, out_dir)
    if name is None:
        return None, public
    if is_absolute(name):
        return (public if path is not None else public_path(name, out_dir)), public
    local = path is not None and public != name and _bundled_name(Path(os.fspath(path))) is None \
        and _hub_cache_part(Path(os.fspath(path))) is None and Path(name).expanduser().exists()
    if local and _HUB_ID.match(name):
        return f"./{name}", public
    return name, public


def scrub_absolute(value: Any, out_dir) -> Any:
    """`value` (parsed JSON) with every string that is an absolute path made public (`public_path`)."""
    if isinstance(value, dict):
        return {k: scrub_absolute(v, out_dir) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub_absolute(v, out_dir) for v in value]
    return public_path(value, out_dir) if is_absolute(value) else value


def public_report(name: str, report: Any, out_dir) -> Any:
    """A report (parsed `name`, one of REPORT_FILES) with its model names and every absolute path made public."""
    if not isinstance(report, dict):
        return scrub_absolute(report, out_dir)
    report = json.loads(json.dumps(report))  # a copy: the caller's stays as it was
    pairs = list(MODEL_PAIRS.get(name, []))
    if name == "eval_results.json":
        pairs = [(("models", role), "name", "path") for role in (report.get("models") or {})]
    for where, key, path_key in pairs:
        section = report
        for step in where:
            section = section.get(step) if isinstance(section, dict) else None
        if isinstance(section, dict) and (section.get(key) is not None or section.get(path_key) is not None):
            name, path = public_model(section.get(key), section.get(path_key), out_dir)
            section.update({k: v for k, v in ((key, name), (path_key, path)) if k in section})
    return scrub_absolute(report, out_dir)


LOCAL_FILE = ".attnkit-local.json"  # in OUT, never uploaded (hub.IGNORE_PATTERNS): where its models really are


def publish_reports(folder: Path, out_dir: str | os.PathLike) -> None:
    """Rewrite the reports in `folder` (about to become `out_dir`) without absolute paths. Called when a
    folder is complete, after its model card was written from the reports as they were. The absolute
    folders of the (name, folder) pairs are kept for this machine in LOCAL_FILE (`local_folder`), so that
    `teacher: source` still finds a source outside the working directory."""
    local: dict[str, dict[str, str]] = {}
    for name in REPORT_FILES:
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        public = public_report(name, report, out_dir)
        if public == report:
            continue
        path.write_text(json.dumps(public, indent=2) + "\n", encoding="utf-8")
        for where, _, path_key in MODEL_PAIRS.get(name, []):
            section = report
            for step in where:
                section = section.get(step) if isinstance(section, dict) else None
            value = section.get(path_key) if isinstance(section, dict) else None
            if isinstance(value, str) and value and Path(value).expanduser().is_absolute():
                local.setdefault(name, {})[".".join([*where, path_key])] = value
    if local:
        (Path(folder) / LOCAL_FILE).write_text(json.dumps(local, indent=2) + "\n", encoding="utf-8")


def local_folder(folder: Path, report: str, key: str) -> Path | None:
    """The absolute folder a report's `key` (dotted) named before `publish_reports` made it public,
    when this machine still has it."""
    try:
        value = json.loads((Path(folder) / LOCAL_FILE).read_text(encoding="utf-8"))[report][key]
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError):
        return None
    return Path(value) if isinstance(value, str) and Path(value).is_dir() else None
