"""The conversion methods, found in their folders: each `attnkit/converters/<folder>/__init__.py`
declares `METHODS`, a tuple of `Method`. The CLI's `--to` choices and option groups, the dispatcher,
the API, the printout and the model card (its titles, each method's own sections) all read this
registry, so a new method is a new folder (see docs/architecture.md).

Discovery imports only the folders' `__init__` and `config` modules: no torch, `attnkit --help` stays fast.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass

from attnkit.errors import AttnkitError


@dataclass(frozen=True)
class Method:
    """One `--to` value.

    name: what `--to` takes; a `+` joins the steps of a composite (`mla+dex`: MLA, then DEX on it).
    title: the model card's words for the attention the output has.
    help: one line for `attnkit convert --help`.
    converter: "module:function" taking the parsed settings, imported only when the method runs.
    configs: the option classes the method reads (their fields are its CLI group and its API config).
    summary: optional "module:function" (report) -> extra printout lines for the method.
    card: optional "module:function" (the card's reports) -> `attnkit.card.hooks.MethodSections`: what
        the model card says that only this method knows. Each distinct hook is asked about every card
        and speaks only when its part is in the folder (attnkit/card/hooks.py).
    order: position in `--to`'s choices.
    """

    name: str
    title: str
    help: str
    converter: str
    configs: tuple[type, ...] = ()
    summary: str | None = None
    card: str | None = None
    order: int = 100

    def __post_init__(self) -> None:
        if not isinstance(self.configs, tuple):  # `(MLAConfig)` is not a tuple: said at registration
            raise TypeError(f"method {self.name!r}: configs must be a tuple of option classes, got {self.configs!r}")

    @property
    def steps(self) -> tuple[str, ...]:
        return tuple(self.name.split("+"))


@functools.cache
def methods() -> dict[str, Method]:
    """Every registered method by name, in `order`."""
    import attnkit.converters as package

    found: list[Method] = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.ispkg:
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            found.extend(getattr(module, "METHODS", ()))
    names = [m.name for m in found]
    if len(set(names)) != len(names):
        raise RuntimeError(f"a method name is registered twice: {sorted(names)}")
    return {m.name: m for m in sorted(found, key=lambda m: (m.order, m.name))}


def get(name: str) -> Method:
    try:
        return methods()[name]
    except KeyError:
        raise AttnkitError(f"unknown method {name!r} (known: {', '.join(methods())})") from None


def option_classes() -> list[type]:
    """Every method's option classes, once each, in the order methods first use them (the CLI's groups)."""
    seen: list[type] = []
    for method in methods().values():
        seen.extend(c for c in method.configs if c not in seen)
    return seen


def users_of(cls: type) -> list[str]:
    """The methods that read the option class `cls`."""
    return [m.name for m in methods().values() if cls in m.configs]


def load(spec: str):
    """The function "module:function" names (imported now)."""
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)
