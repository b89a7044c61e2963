"""Typed options: each group of settings is a dataclass whose fields carry their command-line flag,
help and choices. The CLI is built from these classes and the Python API takes instances of them, so
a setting's name, default, help and checks are written once.

Kept free of torch and transformers: `attnkit --help` imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from attnkit.errors import AttnkitError

_TYPES = {int: int, float: float, str: str}


def int_list(text: str) -> list[int]:
    """"1024,4096" -> [1024, 4096]: how a `tuple[int, ...]` option is written on the command line. At
    least one value, every one positive."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def option(default: Any, help: str, *, choices: tuple | None = None, metavar: str | None = None,
           flag: str | None = None, negatable: bool = False) -> Any:
    """A dataclass field that is also a command-line option (`--field-name` unless `flag`).
    `negatable`: a boolean with `--name` / `--no-name` (argparse's BooleanOptionalAction)."""
    meta = {"help": help, "choices": choices, "metavar": metavar, "flag": flag, "negatable": negatable}
    return dataclasses.field(default=default, metadata={"option": meta})


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["option"]["flag"] or "--" + f.name.replace("_", "-")


def _base_type(hint: Any) -> type:
    """int for `int` and `int | None`, tuple for `tuple[int, ...]`: the kind of value a field holds."""
    if typing.get_origin(hint) is tuple:
        return tuple
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return _base_type(args[0]) if args else hint


def fields_of(cls: type) -> list[tuple[dataclasses.Field, type]]:
    """The option fields of a settings class with their resolved types."""
    hints = typing.get_type_hints(cls)
    return [(f, _base_type(hints[f.name])) for f in dataclasses.fields(cls) if "option" in f.metadata]


def add_arguments(parser: argparse.ArgumentParser | Any, cls: type) -> None:
    """One argparse option per field of `cls` (into a parser or an argument group)."""
    for f, kind in fields_of(cls):
        meta = f.metadata["option"]
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if meta["negatable"] else "store_true"
        else:
            kwargs["type"] = int_list if kind is tuple else _TYPES[kind]
            if kind is tuple:  # argparse gives a list; the help shows it as one
                kwargs["default"] = list(f.default)
            if meta["choices"]:
                kwargs["choices"] = list(meta["choices"])
            if meta["metavar"]:
                kwargs["metavar"] = meta["metavar"]
        parser.add_argument(flag_of(f), **kwargs)


def from_namespace(cls: type, namespace: argparse.Namespace) -> Any:
    """The settings instance a parsed command line describes."""
    return cls(**{f.name: getattr(namespace, f.name) for f, _ in fields_of(cls)})


def given(cls: type, namespace: argparse.Namespace) -> list[str]:
    """Flags of `cls` whose value differs from the default: what the user set."""
    return [flag_of(f) for f, _ in fields_of(cls) if getattr(namespace, f.name, f.default) != f.default]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _of_kind(value: Any, kind: type) -> bool:
    """Whether `value` is what argparse would have made of the text: an int is a float too; a tuple
    option takes a tuple or list of positive ints (`int_list`)."""
    if kind is tuple:
        return isinstance(value, (tuple, list)) and len(value) > 0 and all(_is_int(v) and v > 0 for v in value)
    if kind is float:
        return isinstance(value, float) or _is_int(value)
    return _is_int(value) if kind is int else isinstance(value, kind)


def check_types(instance: Any) -> None:
    """The API's counterpart of argparse's conversion: each field of the right type and among its
    choices, said in the CLI's words (the flag) so both interfaces refuse alike."""
    for f, kind in fields_of(type(instance)):
        value = getattr(instance, f.name)
        if value is None and f.default is None:
            continue
        if not _of_kind(value, kind):
            what = "comma-separated positive integers" if kind is tuple else kind.__name__
            raise AttnkitError(f"{flag_of(f)} takes {what}, got {value!r}")
        choices = f.metadata["option"]["choices"]
        if choices and value not in choices:
            raise AttnkitError(f"{flag_of(f)} must be one of {', '.join(map(str, choices))}, got {value!r}")


def apply_options(namespace: argparse.Namespace, cls: type, options: dict[str, Any], command: str,
                  others: str = "") -> Any:
    """Keyword options of an API call onto a parsed namespace: each must be a field of `cls` (else one
    line naming the ones there are), then the whole instance is type-checked. Returns the instance."""
    known = {f.name for f, _ in fields_of(cls)}
    for key, value in options.items():
        if key not in known:
            raise AttnkitError(f"{command}() has no option {key!r} (options: {', '.join(sorted(known))}{others})")
        setattr(namespace, key, value)
    settings = from_namespace(cls, namespace)
    check_types(settings)
    return settings


def into_namespace(instance: Any, namespace: argparse.Namespace) -> None:
    for f, _ in fields_of(type(instance)):
        setattr(namespace, f.name, getattr(instance, f.name))
