"""Where the C kernels' shared library is cached, and whether a folder or file there may be used.

Loading a library runs its code (its constructors run inside dlopen), so the executor loads one
only from where nobody but this user could have written it: the file must be this user's and
writable by nobody else, and so must its folder and every folder between that folder and the base
it was made under (a shared base such as /tmp is fine: nobody can replace what is ours in it).
Folders, the first that passes:

- $SPLITSERVE_KERNEL_CACHE, when set;
- $XDG_CACHE_HOME/splitserve/kernels, else $HOME/.cache/splitserve/kernels;
- <temp folder>/splitserve-kernels-<uid>, this user's own (where there is no home, or the others
  are refused).

A missing folder is created private (0700), with any missing parents, which are then checked as
well. An existing one need only be writable by nobody else (0755 passes). A refused folder or file
is logged once, event=kernel_cache_refused path=... reason=..., and never used.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PRIVATE_MODE = 0o700
WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


@dataclass(slots=True, frozen=True)
class CacheFolder:
    """A folder the library may be cached in, and the base it is made under. The base (the
    user's cache folder, the temp folder, the parent of an explicit folder) is the user's or the
    system's; every folder below it down to `path` is ours and must be private."""

    path: Path
    base: Path


def candidate_folders(environ: Mapping[str, str]) -> list[CacheFolder]:
    """The folders to try, in order (module docstring)."""
    folders: list[CacheFolder] = []
    explicit = environ.get("SPLITSERVE_KERNEL_CACHE")
    if explicit:
        path = Path(explicit).absolute()
        folders.append(CacheFolder(path, path.parent))
    cache_home = _absolute(environ.get("XDG_CACHE_HOME"))
    home = _absolute(environ.get("HOME"))
    if cache_home is None and home is not None:
        cache_home = home / ".cache"
    if cache_home is not None:
        folders.append(CacheFolder(cache_home / "splitserve" / "kernels", cache_home))
    temp = Path(tempfile.gettempdir())
    folders.append(CacheFolder(temp / f"splitserve-kernels-{os.geteuid()}", temp))
    return folders


def private_cache_folder() -> Path | None:
    """The first candidate folder that passes, created where missing; None when all are refused
    (each logged)."""
    for folder in candidate_folders(os.environ):
        reason = folder_refusal(folder)
        if reason is None:
            return folder.path
        log_refusal(folder.path, reason)
    return None


def folder_refusal(folder: CacheFolder) -> str | None:
    """Why `folder` may not hold the library, or None; creates it (and missing parents) first."""
    try:
        created = _make_private(folder.path)
    except OSError as error:
        return f"cannot create it: {error}"
    ancestors = (folder.path, *folder.path.parents)
    below_base = [p for p in ancestors if p != folder.base and p.is_relative_to(folder.base)]
    for path in sorted({folder.path, *created, *below_base}, key=lambda p: len(p.parts)):
        reason = _refusal(path, stat.S_ISDIR, "a folder", follow_symlinks=True)
        if reason is not None:
            return reason
    return None


def library_refusal(path: Path) -> str | None:
    """Why the file at `path` may not be loaded, or None: it must be a plain file (a symbolic
    link could point anywhere) that is this user's and writable by nobody else."""
    return _refusal(path, stat.S_ISREG, "a plain file", follow_symlinks=False)


def log_refusal(path: Path, reason: str) -> None:
    logger.warning("event=kernel_cache_refused path=%s reason=%r", path, reason)


def _refusal(path: Path, is_kind: Callable[[int], bool], kind: str, follow_symlinks: bool) -> str | None:
    """Why path is not `kind` (is_kind tells by its mode), this user's, and writable by nobody
    else; None when it is."""
    try:
        status = os.stat(path, follow_symlinks=follow_symlinks)
    except OSError as error:
        return f"cannot inspect {path}: {error}"
    if not is_kind(status.st_mode):
        return f"{path} is not {kind}"
    user = os.geteuid()
    if status.st_uid != user:
        return f"{path} is owned by uid {status.st_uid}, not by this user (uid {user})"
    if status.st_mode & WRITABLE_BY_OTHERS:
        return f"{path} is writable by its group or others (mode {stat.S_IMODE(status.st_mode):04o})"
    return None


def _make_private(path: Path) -> list[Path]:
    """Creates `path` and its missing parents, each 0700; the folders that were missing."""
    missing: list[Path] = []
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, PRIVATE_MODE)
        except FileExistsError:
            # Another executor starting beside this one made it first; it is checked like ours.
            pass
    return missing


def _absolute(value: str | None) -> Path | None:
    """value as a path when it is an absolute one (XDG's rule: a relative one is ignored)."""
    return Path(value) if value and os.path.isabs(value) else None
