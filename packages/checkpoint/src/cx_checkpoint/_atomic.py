"""Atomic, durable placement of checkpoint files and directories: nothing half-written ever sits at the target.

A save writes into a hidden staging sibling (`.<name>.cx-staging-<token>`), fsyncs every file and the directory,
then moves it into place last: a new directory is renamed, an existing one is swapped with `renameat2`
(RENAME_EXCHANGE, one atomic step on Linux) and the old content deleted afterwards. Files are replaced with
`os.replace`. Where the exchange is unavailable the fallback renames the old directory aside first; that leaves a
short window, documented in docs/checkpoint.md, in which the path is absent but the old checkpoint is intact beside it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from cx_checkpoint._errors import CheckpointPathError

__all__ = [
    "commit_directory",
    "commit_file",
    "fsync_directory",
    "fsync_file",
    "new_token",
    "remove_stale_staging",
    "staging_path",
    "write_file_atomic",
]

_STAGING = "cx-staging"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def new_token() -> str:
    return secrets.token_hex(6)


def staging_path(target: Path, token: str) -> Path:
    """The hidden sibling a save to `target` writes into before committing."""
    return target.parent / f".{target.name}.{_STAGING}-{token}"


def remove_stale_staging(target: Path) -> None:
    """Delete staging leftovers of earlier, interrupted saves to `target` (one saver per path is assumed)."""
    if not target.parent.is_dir():
        return
    for leftover in target.parent.glob(f".{target.name}.{_STAGING}-*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                leftover.unlink()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(target: Path, write: Callable[[Path], object]) -> None:
    """Call `write(tmp)` on a staging sibling of `target`, fsync it, then replace `target` with it."""
    if target.is_dir():
        raise CheckpointPathError(f"{target} is a directory; an unsharded checkpoint is a single file path")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(target)
    tmp = staging_path(target, new_token())
    try:
        write(tmp)
        fsync_file(tmp)
        commit_file(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def commit_file(staged: Path, target: Path) -> None:
    os.replace(staged, target)
    fsync_directory(target.parent)


def commit_directory(staged: Path, target: Path) -> None:
    """Move the fully written directory `staged` to `target` atomically, replacing any previous checkpoint."""
    fsync_directory(staged)
    if target.exists() or target.is_symlink():
        if not target.is_dir() or target.is_symlink():
            raise CheckpointPathError(f"{target} exists and is not a directory; a sharded checkpoint is a directory")
        if _exchange(staged, target):
            fsync_directory(target.parent)
            shutil.rmtree(staged)  # now holds the previous checkpoint
            return
        aside = target.parent / f".{target.name}.cx-previous-{new_token()}"
        os.rename(target, aside)
        os.rename(staged, target)
        fsync_directory(target.parent)
        shutil.rmtree(aside)
        return
    os.rename(staged, target)
    fsync_directory(target.parent)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE) of {first} and {second} failed: {os.strerror(code)}")
