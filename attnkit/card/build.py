"""The whole card from the reports, and the folder's README.md: `convert` and `finetune` write it just
before their atomic rename, `attnkit eval --out` refreshes it, `attnkit push` rebuilds it with the repo id."""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import ModelCard

from attnkit.card.hooks import method_sections, method_title
from attnkit.card.metadata import build_card_data
from attnkit.card.names import source_model
from attnkit.card.reports import CARD_FILE, GENERATED_MARKER, method_of, needs_remote_code, read_reports
from attnkit.card.sections import conversion_section, eval_section, finetune_section, usage_section
from attnkit.errors import AttnkitError

_TMP_NAME = re.compile(r"^\.(.+)\.attnkit-tmp-(?:[0-9]+-)?[0-9a-f]+$")


def build_card(reports: dict[str, dict | None], repo_id: str | None = None, name: str | None = None) -> ModelCard:
    """The whole card from the reports (pure: no file access). `name`: title when there is no repo id yet."""
    convert, finetune, eval_results, config = reports["convert"], reports["finetune"], reports["eval"], reports["config"]
    title = repo_id.split("/")[-1] if repo_id else (name or "attnkit model")
    data = build_card_data(reports, model_name=title)
    source = source_model(convert, finetune)
    method = method_of(convert)
    extra = method_sections(reports)
    summary = f"`{source}` with its attention rewritten" if source else "A model with its attention rewritten"
    if method:
        summary += f" to {method_title(method)}"
    summary += " by attnkit"
    summary += ", then healed by a short distillation fine-tune." if finetune else "."
    sections = [GENERATED_MARKER, "", f"# {title}", "", summary]
    if convert:
        sections += ["", conversion_section(convert, extra)]
    if finetune:
        sections += ["", finetune_section(finetune)]
    if eval_results:
        sections += ["", eval_section(eval_results)]
    remote_code = needs_remote_code(convert, finetune, config)
    sections += ["", usage_section(remote_code, reports, repo_id or "PATH_OR_REPO_ID", extra)]
    body = "\n".join(sections) + "\n"
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def display_name(folder: Path) -> str:
    """OUT's name, also while convert/finetune still write into their `.OUT.attnkit-tmp-XXXX` folder."""
    match = _TMP_NAME.match(folder.name)
    return match.group(1) if match else folder.name


def generated_card(folder: Path, repo_id: str | None = None) -> str | None:
    """The card attnkit would write for `folder` (no file is written), or None when the folder's
    README.md is not attnkit's (no marker line): a user's own card wins and is used as it is."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AttnkitError(f"{folder} is not a folder")
    path = folder / CARD_FILE
    if path.is_file() and GENERATED_MARKER not in path.read_text(encoding="utf-8", errors="replace"):
        return None
    return str(build_card(read_reports(folder), repo_id=repo_id, name=display_name(folder)))


def save_card(folder: Path, text: str) -> Path:
    """Write `text` as the folder's README.md through a temporary file (never a half-written card)."""
    path = Path(folder) / CARD_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8", newline="")
    tmp.replace(path)
    return path


def write_model_card(folder: Path, repo_id: str | None = None) -> Path:
    """Write README.md into `folder` from the reports it holds; returns the path.

    Never replaces a README that attnkit did not write (no marker line): a user's own card wins.
    """
    text = generated_card(folder, repo_id)
    return Path(folder) / CARD_FILE if text is None else save_card(folder, text)
