"""Flags that name a local folder (a model, a tokenizer). Nothing is ever downloaded, so a name
that is no folder here is refused with what to pass instead; a Hugging Face hub id given as a
path gets told so."""

from __future__ import annotations

import re
from pathlib import Path

# ORG/NAME as the hub spells repositories: what a user copies from a model page.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
PREPARE_HINT = "`splitserve prepare-model` prepares the default model and prints its folder"


class FolderError(ValueError):
    """A flag names no usable local folder; the message starts with the path and says what is
    missing and what to pass."""


def looks_like_hub_id(name: str) -> bool:
    return _HUB_ID.fullmatch(name) is not None


def require_folder(path: Path, holds: str) -> None:
    """Raises FolderError unless path is a folder; holds: what such a folder holds, for the
    message."""
    if path.is_dir():
        return
    if path.exists():
        raise FolderError(f"{path}: a file, not a folder; pass the folder that holds {holds}")
    if looks_like_hub_id(str(path)):
        raise FolderError(
            f"{path}: no such folder here, and nothing is downloaded (this looks like a Hugging "
            f"Face hub id): fetch it yourself (`hf download {path} --local-dir DIR`) and pass DIR, "
            f"or pass another local folder that holds {holds} ({PREPARE_HINT})"
        )
    raise FolderError(f"{path}: no such folder; pass a local folder that holds {holds} ({PREPARE_HINT})")
