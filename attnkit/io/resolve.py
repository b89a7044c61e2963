"""MODEL arguments: the word `reference`, a local folder, or a Hub id."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from attnkit.errors import AttnkitError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
# the bundled pretrained models a MODEL word names, and the recipe that rebuilds each
BUNDLED = {"reference": "recipes/reference.yaml", "reference-qwen3": "recipes/reference-qwen3.yaml",
           "reference-mha": "recipes/reference-mha.yaml"}
REFERENCE_DIR = ASSETS / "reference"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def resolve_model(spec: str, revision: str | None = None) -> Path:
    """Return a local folder holding `config.json` for MODEL.

    Hub ids go through `huggingface_hub.snapshot_download`, which honours `HF_HUB_OFFLINE`
    (then only the local cache is used) and `HF_ENDPOINT`.
    """
    if spec in BUNDLED:
        return _bundled(spec)
    path = Path(spec).expanduser()
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        if not path.is_dir():
            raise AttnkitError(f"model path {spec} does not exist or is not a folder")
        return _check_folder(path)
    if not _HUB_ID.match(spec):
        raise AttnkitError(f"{spec!r} is neither a local folder, a Hub id (owner/name) nor 'reference'")
    return _check_folder(_download(spec, revision))


def _bundled(name: str) -> Path:
    """A bundled model's folder (`reference`, `reference-qwen3`, `reference-mha`); the word wins over a folder of that name."""
    folder = ASSETS / name
    if not (folder / "config.json").is_file():
        raise AttnkitError(f"the bundled model {name} is missing from {folder}; build it with "
                           f"`attnkit pretrain --config {BUNDLED[name]}`")
    if Path(name).exists():  # say which one is used
        print(f"attnkit: `{name}` is the bundled model ({folder}); for the folder here, write ./{name}", file=sys.stderr)
    return folder


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                # README.md: its front matter (license, datasets, language) is carried into the output's card
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.jinja", "README.md"],
            )
        )
    except RepositoryNotFoundError:
        raise AttnkitError(f"model {repo_id!r} not found on the Hub (or it is gated and no token was given)") from None
    except LocalEntryNotFoundError:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        why = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else "the Hub cannot be reached"
        raise AttnkitError(f"cannot get model {repo_id!r}: {why}") from None
    except (HfHubHTTPError, OSError) as exc:
        raise AttnkitError(f"cannot download model {repo_id!r}: {str(exc).splitlines()[0]}") from None


def _check_folder(path: Path) -> Path:
    config = path / "config.json"
    if not config.is_file():
        raise AttnkitError(f"{path} has no config.json: not a Hugging Face model folder")
    try:
        json.loads(config.read_text())
    except ValueError as exc:
        raise AttnkitError(f"{config} is not valid JSON ({exc})") from None
    return path


def load_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def check_causal_lm(path: Path) -> dict:
    """Refuse folders whose config is not a causal language model transformers knows."""
    config = load_config(path)
    archs = config.get("architectures") or []
    if not any(a.endswith("ForCausalLM") for a in archs) and "auto_map" not in config:
        raise AttnkitError(
            f"{path} is not a causal language model (architectures: {archs or 'none'}; expected *ForCausalLM)"
        )
    return config
