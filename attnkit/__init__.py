"""attnkit: retrofit the attention of pretrained Hugging Face language models.

The Python API (`attnkit/api.py`, docs/api.md): `convert`, `heal`, `evaluate`, `bench`, `push`, each
the command of the same name; the methods' option classes are `MLAConfig`, `DexConfig`, `DiffConfig`,
`GQAConfig`, `TitansConfig`. Imported on first use, so `import attnkit` stays light.
"""

__version__ = "0.1.0"

_API = ("convert", "heal", "evaluate", "bench", "push", "Report")
_CONFIGS = {
    "MLAConfig": "attnkit.converters.mla.config",
    "DexConfig": "attnkit.converters.dex.config",
    "DiffConfig": "attnkit.converters.diff.config",
    "GQAConfig": "attnkit.converters.gqa.config",
    "TitansConfig": "attnkit.converters.titans.config",
}
__all__ = [*_API, *_CONFIGS, "AttnkitError", "__version__"]


def __getattr__(name: str):
    import importlib

    if name in _API:
        return getattr(importlib.import_module("attnkit.api"), name)
    if name in _CONFIGS:
        return getattr(importlib.import_module(_CONFIGS[name]), name)
    if name == "AttnkitError":
        from attnkit.errors import AttnkitError

        return AttnkitError
    raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
