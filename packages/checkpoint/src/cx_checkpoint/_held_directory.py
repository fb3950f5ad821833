"""Opening a checkpoint's files relative to one held directory handle: a save replaced while opening it
(`_Replaced`, `_replaced`) is told apart from a missing file, and symbolic links leading outside are refused.

Kept apart from `CheckpointReader` because these are the only places that touch paths; the reader then works on
the descriptors they return.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cx_checkpoint._errors import CheckpointPathError


class _Replaced(Exception):
    """The directory being opened was replaced by a newer save while opening it: open again."""


def _open_directory(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except FileNotFoundError:
        raise _Replaced() from None
    except NotADirectoryError:
        raise CheckpointPathError(f"{path} is not a directory") from None


def _replaced(path: Path, directory: int) -> bool:
    """Whether `path` now names another directory than the one held open (a newer save was committed)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return True
    held = os.fstat(directory)
    return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)


def _open_inside(directory_path: Path, directory: int, name: str, where: Path) -> int | None:
    """Open `name` relative to the held directory; None when absent. A symlink leading outside is refused."""
    try:
        info = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        root = os.path.realpath(directory_path)
        target = os.path.realpath(directory_path / name)
        if os.path.commonpath([root, target]) != root:
            raise CheckpointPathError(
                f"{where}: {name} is a symbolic link to {target}, outside the checkpoint directory {root}: refused "
                "(a checkpoint's files must live inside it)"
            )
    try:
        fd = os.open(name, os.O_RDONLY, dir_fd=directory)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointPathError(f"{where}: {name} is not a regular file")
    return fd
