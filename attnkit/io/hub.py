"""`attnkit push`: publish a converted/healed folder to the Hugging Face Hub with its model card.

Order of work: everything that can be checked locally (the folder loads: config, weights,
tokenizer, remote code; the token exists; the repo id is well formed) is checked BEFORE the
first network call, so a bad folder never leaves a half-filled repository behind. Then
card validation → `create_repo(exist_ok=True)` → (branch) → `upload_folder`.

The folder itself is not touched until the upload succeeded: the refreshed card (it names the
repo id) is uploaded from a staging folder of symlinks to the folder's files plus the new
README.md, and written into the folder only afterwards, so a failed push changes nothing there.

Resumability: with `hf_xet` installed (a default dependency of huggingface_hub on x86-64 and
arm64), `upload_folder` streams files in several commits and an interrupted push resumes by
re-running the same command (committed files are skipped, uploaded chunks deduplicated).
huggingface_hub 2.x has no separate `upload_large_folder`; this is its replacement.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from attnkit.card.build import generated_card, save_card
from attnkit.card.reports import CARD_FILE
from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import INDEX_FILE, LazyCheckpoint, check_finite, keys_of, scratch_dir

# Never uploaded: training state, caches, editor/OS litter and attnkit's own temporary files.
# Directory patterns end with "/" (huggingface_hub matches everything below them).
IGNORE_PATTERNS = [
    "checkpoint-*/", "*/checkpoint-*/", "checkpoints/", "*/checkpoints/",
    "global_step*/", "runs/", "wandb/", "logs/",
    ".cache/", "*/.cache/", "__pycache__/", "*/__pycache__/", ".ipynb_checkpoints/",
    ".*.attnkit-tmp-*/", ".attnkit-local.json", ".tmp-*/", "*/.tmp-*/", "*.pyc", "*.tmp", "*.lock", "*.part", "*.incomplete", ".DS_Store",
    "optimizer*.pt", "optimizer*.bin", "scheduler*.pt", "rng_state*.pth", "scaler.pt",
    "training_args.bin", "trainer_state.json", "accelerator_state/",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
HTTP_HINTS = {
    401: "the Hub rejected the token (401 Unauthorized); check --token, HF_TOKEN or `hf auth login`",
    403: "the token may not write to {repo} (403 Forbidden); it needs write access to that namespace",
    404: "{repo} or revision {revision} was not found on {endpoint} (404)",
    409: "conflict on {repo} (409): {detail}",
}


@dataclass(frozen=True)
class PushPlan:
    """What will be sent, decided before any network call."""

    folder: Path
    files: list[str]
    total_bytes: int
    remote_code: bool


# ---------------------------------------------------------------- local checks (no network)


def upload_files(folder: Path) -> list[str]:
    """Relative POSIX paths that `upload_folder` will send (same filter it applies)."""
    from huggingface_hub.utils import filter_repo_objects

    rel = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    rel = [r for r in rel if not (r.startswith(".git/") or "/.git/" in r)]
    return list(filter_repo_objects(rel, ignore_patterns=IGNORE_PATTERNS))


def _check_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise AttnkitError(f"{folder} has no config.json: not a model folder (push the OUT of `attnkit convert`/`finetune`)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise AttnkitError(f"{path} does not parse as JSON ({exc})") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise AttnkitError(f"{path} has no model_type: transformers could not load it")
    return config


def _check_remote_code(folder: Path, config: dict) -> bool:
    """An `auto_map` must point at Python files that ship in the folder."""
    auto_map = config.get("auto_map") or {}
    for target in auto_map.values():
        for ref in [target] if isinstance(target, str) else [t for t in target if t]:
            module = ref.split("--")[-1].rsplit(".", 1)[0]
            if "--" not in ref and not (folder / f"{module.replace('.', '/')}.py").is_file():
                raise AttnkitError(f"config.json auto_map names {ref!r} but {module}.py is not in {folder}")
    return bool(auto_map)


def _check_weights(folder: Path) -> set[str]:
    """Every shard opens and its first tensor reads (safetensors checks header vs file size on open);
    returns the tensor names."""
    ckpt = LazyCheckpoint(folder)
    if not ckpt.keys():
        raise AttnkitError(f"the weights in {folder} hold no tensors")
    first_per_shard: dict[str, str] = {}
    for name, shard in ckpt.weight_map.items():
        first_per_shard.setdefault(shard, name)
    for name in first_per_shard.values():
        ckpt.get(name)
    if (folder / INDEX_FILE).is_file():
        for shard in first_per_shard:
            listed = {n for n, s in ckpt.weight_map.items() if s == shard}
            if not listed <= set(keys_of(folder / shard)):
                raise AttnkitError(f"{shard} lacks tensors that {INDEX_FILE} lists in it")
    return set(ckpt.keys())


def _check_tensor_names(folder: Path, names: set[str]) -> None:
    """The weights hold every tensor the config's model needs (model built on the meta device: no memory).

    Skipped for remote-code models (checking would execute the folder's code). Model types whose
    checkpoints transformers converts on load (DeepSeek-V3 among them) fuse MoE experts, so expert
    tensors are not compared there; attnkit's dense outputs have none.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    try:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError) as exc:
        raise AttnkitError(f"transformers cannot build a causal LM from {folder / 'config.json'}: {str(exc).splitlines()[0]}") from None
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = sorted(set(model.state_dict()) - tied - names)
    if get_checkpoint_conversion_mapping(config.model_type):
        missing = [name for name in missing if ".experts." not in name]
    if missing:
        raise AttnkitError(f"the weights lack {len(missing)} tensor(s) that config.json's model needs, e.g. {missing[0]}")


def _check_tokenizer(folder: Path) -> None:
    present = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not present:
        raise AttnkitError(f"no tokenizer in {folder} (expected one of {', '.join(TOKENIZER_FILES)})")
    if "tokenizer.json" in present:
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises bare Exception subclasses
            raise AttnkitError(f"{folder / 'tokenizer.json'} does not load: {str(exc).splitlines()[0]}") from None


def validate_folder(folder: str | os.PathLike) -> PushPlan:
    """Refuse a folder that would not load; return what would be uploaded."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AttnkitError(f"{folder} is not a folder")
    config = _check_config(folder)
    remote_code = _check_remote_code(folder, config)
    names = _check_weights(folder)
    if not remote_code:
        _check_tensor_names(folder, names)
    _check_tokenizer(folder)
    check_finite(folder)  # reads every weight, so last: a NaN/Inf weight is not published
    files = upload_files(folder)
    total = sum((folder / f).stat().st_size for f in files)
    return PushPlan(folder=folder, files=files, total_bytes=total, remote_code=remote_code)


def check_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise AttnkitError(f"bad --repo-id {repo_id!r}: {str(exc).splitlines()[0]}") from None
    if repo_id.count("/") != 1:
        raise AttnkitError(f"--repo-id must be USER/NAME or ORG/NAME, got {repo_id!r}")


def resolve_token(token: str | None) -> str:
    """--token, else HF_TOKEN, else the saved `hf auth login` token."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise AttnkitError("no Hub token: pass --token, set HF_TOKEN, or run `hf auth login`")
    return token


def resolve_endpoint(endpoint: str | None) -> str:
    from huggingface_hub import constants

    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


# ---------------------------------------------------------------- network


def _http_error(exc: Exception, repo: str, revision: str, endpoint: str) -> AttnkitError:
    """One line for any Hub failure; the status code decides the wording."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    detail = ""
    if response is not None:
        try:
            detail = str(response.json().get("error", ""))
        except Exception:
            detail = (getattr(response, "text", "") or "")[:200]
    detail = " ".join(detail.split())
    if status in HTTP_HINTS:
        msg = HTTP_HINTS[status].format(repo=repo, revision=revision, endpoint=endpoint, detail=detail)
    elif status is not None and status >= 500:
        msg = f"the Hub at {endpoint} failed with a server error ({status}); try again later: re-running the same command resumes the upload"
    elif status is not None:
        msg = f"the Hub answered {status} for {repo}"
    else:
        msg = f"cannot reach the Hub at {endpoint}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if detail and status not in (409,) and detail not in msg:
        msg += f" — server said: {detail}"
    return AttnkitError(msg)


def _validate_card(endpoint: str, token: str, content: str) -> None:
    """The Hub's own metadata check, run before `create_repo` so a bad card never leaves an empty repo."""
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    response = get_session().post(
        f"{endpoint}/api/validate-yaml",
        json={"content": content, "repoType": "model"},
        headers=build_hf_headers(token=token),
    )
    if response.status_code == 400:
        try:
            errors = "; ".join(e.get("message", "") for e in response.json().get("errors", []))
        except Exception:
            errors = response.text[:200]
        raise AttnkitError(f"the Hub rejected the model card metadata in {CARD_FILE}: {errors}")
    hf_raise_for_status(response)


@contextlib.contextmanager
def staged_folder(plan: PushPlan, card: str | None) -> Iterator[Path]:
    """A temporary folder that `upload_folder` sees as the folder to push: a symlink per file of the
    plan (no copy of the weights), with README.md replaced by `card` when one is given. Why: the
    upload must carry the new card while the user's folder stays as it was until the push succeeded.
    Named with this process's pid in the system's temporary folder (`scratch_dir`), so that what a
    SIGKILLed push left there is removed by the next one."""
    with scratch_dir(Path(tempfile.gettempdir()) / "attnkit-push") as stage:
        for rel in plan.files:
            if card is not None and rel == CARD_FILE:
                continue
            link = stage / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            public = public_json(plan.folder / rel)
            if public is None:
                link.symlink_to((plan.folder / rel).absolute())
            else:
                link.write_text(public, encoding="utf-8")
        if card is not None:
            (stage / CARD_FILE).write_bytes(card.encode("utf-8"))
        yield stage


NOT_SCRUBBED = ("tokenizer", "vocab", "added_tokens", "special_tokens_map", "merges")  # their strings are text


def public_json(path: Path) -> str | None:
    """The text to upload for a JSON file that names absolute local paths (reports of older attnkit
    versions, a training summary's recipe), those paths replaced by folder names; None when the file
    goes as it is (not JSON, a tokenizer's file, or nothing to replace)."""
    from attnkit.io.public import public_report

    if path.suffix != ".json" or path.name.startswith(NOT_SCRUBBED) or path.stat().st_size > 64 * 1024**2:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    public = public_report(path.name, data, None)  # local folders by their names only
    if public == data:
        return None
    print(f"attnkit: note: absolute local paths in {path.name} are uploaded as folder names", file=sys.stderr)
    return json.dumps(public, indent=2) + "\n"


def _keep_card(folder: Path, card: str) -> None:
    """After a successful push, the folder's card is the one on the Hub; a read-only folder only gets a note."""
    try:
        save_card(folder, card)
    except OSError as exc:
        print(f"attnkit: note: pushed, but {folder / CARD_FILE} could not be updated ({exc.strerror or exc})", file=sys.stderr)


def push(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    token: str | None = None,
    endpoint: str | None = None,
    private: bool = False,
    revision: str | None = None,
    create_pr: bool = False,
) -> str:
    """Validate, upload with a refreshed card, then keep that card locally; return the URL of the
    commit, PR or repo. Nothing in `folder` changes unless the upload succeeded."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    check_repo_id(repo_id)
    if create_pr and revision not in (None, "main"):
        raise AttnkitError("--create-pr opens a pull request against main; drop --revision")
    plan = validate_folder(folder)
    token = resolve_token(token)
    endpoint = resolve_endpoint(endpoint)
    if constants.is_offline_mode():
        raise AttnkitError("HF_HUB_OFFLINE is set: unset it to push")
    card = generated_card(plan.folder, repo_id=repo_id)  # None: the folder's own README.md goes as it is
    if card is None:
        card_text = (plan.folder / CARD_FILE).read_text(encoding="utf-8", errors="replace")
    else:
        card_text = card
        if CARD_FILE not in plan.files:
            plan.files.append(CARD_FILE)
    print(f"pushing {len(plan.files)} files ({plan.total_bytes / 1e6:.1f} MB) from {plan.folder} to {repo_id} on {endpoint}")

    api = HfApi(endpoint=endpoint, token=token)
    rev = revision or "main"
    try:
        _validate_card(endpoint, token, card_text)  # before the repo exists
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True)
        print(f"repository: {repo_url}")
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        with staged_folder(plan, card) as stage:
            info = api.upload_folder(
                repo_id=repo_id,
                folder_path=stage,
                ignore_patterns=list(IGNORE_PATTERNS),
                revision=revision,
                create_pr=create_pr,
                commit_message="Upload model converted with attnkit",
            )
    except HfHubHTTPError as exc:
        raise _http_error(exc, repo_id, rev, endpoint) from None
    except Exception as exc:
        # transport errors (refused connection, timeout) come from huggingface_hub's HTTP client
        if isinstance(exc, ConnectionError) or type(exc).__module__.startswith(("httpx", "httpcore")):
            raise _http_error(exc, repo_id, rev, endpoint) from None
        raise
    if card is not None:
        _keep_card(plan.folder, card)
    url = getattr(info, "pr_url", None) or getattr(info, "commit_url", None) or str(repo_url)
    if revision and revision != "main":
        print(f"branch: {endpoint}/{repo_id}/tree/{revision}")
    return url


def main(args) -> int:
    """CLI handler for `attnkit push`."""
    url = push(
        args.folder,
        args.repo_id,
        token=args.token,
        endpoint=args.endpoint,
        private=args.private,
        revision=args.revision,
        create_pr=args.create_pr,
    )
    print(url)
    return 0
