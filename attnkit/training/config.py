"""Recipes: YAML files validated against dataclasses, with dotted `key=value` overrides.

The schema *is* a dataclass (`attnkit.training.recipe.Recipe` for fine-tuning,
`attnkit.training.pretrain.PretrainRecipe`): every key a recipe may hold, its type and default.
Validation is strict (unknown key or wrong type → one-line `AttnkitError` naming the dotted key),
because a typo such as `lerning_rate` silently ignored would cost a whole run.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import TypeVar

import yaml

from attnkit.errors import AttnkitError

T = TypeVar("T")


def load_recipe(path: str | Path, cls: type[T], overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Read YAML, apply `a.b=value` overrides, validate against dataclass `cls`, return an instance."""
    path = Path(path)
    if not path.is_file():
        raise AttnkitError(f"recipe {path} not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise AttnkitError(f"recipe {path} is not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise AttnkitError(f"recipe {path} must be a mapping of keys to values")
    for item in overrides:
        apply_override(raw, item)
    return from_dict(cls, raw, "")


def apply_override(raw: dict, item: str) -> None:
    """`train.lr=1e-4` → raw['train']['lr'] = 1e-4 (value parsed as YAML)."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise AttnkitError(f"override {item!r} is not KEY=VALUE")
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise AttnkitError(f"override {key}: {part!r} is not a section")
        node = nxt
    try:
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        node[parts[-1]] = text


def from_dict(cls, raw, prefix: str):
    """Build dataclass `cls` from a mapping, checking every key and type (errors name the dotted key)."""
    if not isinstance(raw, dict):
        raise AttnkitError(f"recipe key {prefix.rstrip('.') or '<root>'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise AttnkitError(f"recipe key {prefix}{key}: unknown key (allowed: {', '.join(sorted(names))})")
    values = {key: _coerce(hints[key], value, prefix + key) for key, value in raw.items()}
    return cls(**values)


def _coerce(hint, value, key: str):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, key)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, key + ".")
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            value = [value] if isinstance(value, (str, int, float)) and not isinstance(value, bool) else value
        if not isinstance(value, list):
            raise AttnkitError(f"recipe key {key}: expected a list, got {type(value).__name__}")
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - schema uses only the types above
        raise TypeError(f"unsupported schema type {hint}")
    raise AttnkitError(f"recipe key {key}: expected {hint.__name__}, got {type(value).__name__} {value!r}")


