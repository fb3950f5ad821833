"""One run per `--save` folder: rank 0 holds an advisory lock beside the folder for the whole run.

Two runs saving into one folder would each clear the other's staging directory as stale and fail mid-save with a bare
`FileNotFoundError: 'optimizer'`. The lock (`fcntl.flock` on `.<name>.cx-writer.lock` in the folder's parent) makes
the second run stop before its first step, on every rank, naming the folder and the first run's process. The kernel
drops the lock with its process, so a killed run never leaves it behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from cx_checkpoint import run_and_agree

__all__ = ["SaveFolderBusy", "hold_save_folder", "save_folder_lock"]


class SaveFolderBusy(RuntimeError):
    """Another live process holds the `--save` folder."""


def _lock_path(save: Path) -> Path:
    return save.parent / f".{save.name}.cx-writer.lock"


def hold_save_folder(save: Path) -> IO[str]:
    """Take the folder's lock without waiting; the open file holds it (close it to release). Raises SaveFolderBusy
    naming the holder's process id when another process has it."""
    save.parent.mkdir(parents=True, exist_ok=True)
    handle = _lock_path(save).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise SaveFolderBusy(
            f"--save {save}: another cx-train run is writing there (process {holder}); give each run its own "
            "--save folder, or wait for that run to end"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


@contextlib.contextmanager
def save_folder_lock(save: Path | None, master: bool) -> Iterator[None]:
    """Hold `save` for this run on the master rank (collective: every rank raises the same error when it is busy)."""
    if save is None:
        yield
        return
    held: list[IO[str]] = []
    run_and_agree((lambda: held.append(hold_save_folder(save))) if master else None, f"taking --save {save}")
    try:
        yield
    finally:
        for handle in held:
            handle.close()
