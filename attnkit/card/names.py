"""How a public card names models and folders: Hub ids as they are, anything local by its last
component (where the files lay on the converting machine is not the card's business)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from attnkit.io.resolve import BUNDLED

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def looks_local(text: str) -> bool:
    """A string that names a place on this machine: absolute, home- or dot-relative, a Windows drive,
    or (as `resolve_model` reads MODEL) more than one slash without spaces. Not a `scheme:` name
    such as `hf:owner/name/config` (a dataset on the Hub)."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", text):
        return False
    return text.startswith(("/", "~", "./", "../", ".\\", "..\\")) or bool(re.match(r"^[A-Za-z]:[\\/]", text)) or (
        text.count("/") > 1 and not any(c.isspace() for c in text))


def local_name(text: str) -> str:
    """A local folder by its name only (`my-llama` for /home/u/my-llama): a card is public, where the
    files lay on the converting machine is not its business and means nothing to a reader."""
    return re.split(r"[\\/]", text.rstrip("/\\"))[-1] or text


def is_hub_id(text: Any, path: Any = None) -> bool:
    """True for an `owner/name` that names a Hub model: not an existing local path, and not what the
    report recorded as the folder it was read from (a relative local folder `out/x` read as `out/x`;
    a Hub model is read from the cache, `.../models--owner--name/snapshots/...`)."""
    if not (isinstance(text, str) and _HUB_ID.match(text)) or Path(text).exists():
        return False
    read_as_folder = isinstance(path, str) and Path(path).as_posix().endswith(text) and "models--" not in path
    return not read_as_folder


def public_name(text: Any, path: Any = None) -> str | None:
    """How the card names a model: a Hub id as it is, anything local by its folder name."""
    if not isinstance(text, str) or not text:
        return None
    if is_hub_id(text, path) or text == "source":
        return text
    if text in BUNDLED:
        return text
    if isinstance(path, str) and Path(path).parts[-3:-1] == ("attnkit", "assets") and Path(path).name in BUNDLED:
        return Path(path).name
    return local_name(text)


def scrub(value: Any) -> Any:
    """`value` with every string that names a local place replaced by its last component (settings,
    recipes and report extras carry output folders, calibration folders and config paths)."""
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v) for v in value]
    if isinstance(value, str) and looks_local(value):
        return local_name(value)
    return value


def source_ref(convert: dict | None, finetune: dict | None) -> tuple[str | None, str | None]:
    """(the name the user gave the original model, the folder it was read from): convert's source,
    else the trainer's teacher, else the model it trained."""
    source = (convert or {}).get("source")
    if isinstance(source, dict) and source.get("model"):
        return str(source["model"]), source.get("path")
    for key in ("teacher", "base_model"):
        if (finetune or {}).get(key):
            return str(finetune[key]), finetune.get(f"{key}_path")
    return None, None


def source_model(convert: dict | None, finetune: dict | None) -> str | None:
    """The original model this folder derives from, as the card may name it (no local paths)."""
    return public_name(*source_ref(convert, finetune))
