"""Processes end with the process that started them: a rank whose launcher (cx-train's, or an outside torchrun's
agent) is gone, or a tokenising worker whose parent is gone, stops within a second.

A launcher killed with SIGKILL (an OOM killer) cannot pass anything on: its ranks used to train on as orphans, and
one wrote a checkpoint 40 s after the user's process was gone, racing any restart on the same folder; forked
tokenising workers kept the token cache's lock, so a restart waited on it with no output. Each such process watches
its parent from a daemon thread (a re-parented process sees `os.getppid()` change) and exits when it changes. Exiting
mid-save is safe: a checkpoint is committed atomically, and the next save removes the leftover staging directory.
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["exit_with_parent"]

_INTERVAL_S = 1.0
_watching: int | None = None  # the process that started a watch (a forked child starts its own)


def exit_with_parent(what: str, parent: int | None = None) -> None:
    """Start watching this process's parent; when it is gone, say so on stderr (naming `what` this process is) and
    exit with status 1 at once. Idempotent per process. `parent`, the pid the creator knew itself by, closes a race:
    a child that starts only after its parent died would otherwise watch its new parent (init) for ever."""
    global _watching
    if _watching == os.getpid():
        return
    _watching = os.getpid()
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(_INTERVAL_S):
            if os.getppid() != parent:
                print(f"cx-train: {what}: its parent process {parent} is gone; stopping", file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="cx-exit-with-parent", daemon=True).start()
