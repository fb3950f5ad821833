"""A rank that fails tells its peers through the job's store, so they stop at once with its error, not at the timeout.

A rank blocked on a peer that has raised would otherwise wait for the whole process-group timeout and then report
a bare transport error. `launch` installs an excepthook: an uncaught exception on a rank prints its traceback,
records "rank N raised Type: message" under one well-known key of the default group's store (the first failure wins) and
ends the process at once (`os._exit`, so no interpreter teardown can keep its connections open). Its peers'
transfers then fail within moments (gloo notices the closed connection), and `named_collective` turns that error
into a `PeerFailedError` that names the rank that failed first and what it raised. Waits on collectives poll the
record between short slices as well (`failure_of_peer`), for a failed rank whose process is still alive. A peer that
is alive and has recorded nothing (a long save) still gets the full timeout.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from types import TracebackType
from typing import Any

import torch.distributed as dist

__all__ = [
    "FAILURE_KEY",
    "PeerFailedError",
    "default_store",
    "failure_of_peer",
    "install_failure_hook",
    "report_failure",
]

FAILURE_KEY = "cx/first_failure"  # in the default group's store; its value is "rank N raised Type: message"
_MESSAGE_LIMIT = 2000  # characters of the failed rank's message kept in the record


class PeerFailedError(RuntimeError):
    """A rank this one was waiting for has failed (raised, or its process ended): the run cannot continue."""


def default_store() -> Any | None:
    """The default group's store (no public accessor in torch; best effort), or None when there is none."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def report_failure(error: BaseException) -> None:
    """Record `error` as this rank's failure in the job's store, unless an earlier failure is recorded already.

    Never raises: a failing rank must get on with failing (a store that is gone, e.g. because the rank hosting it
    ended, just leaves nothing recorded)."""
    store = default_store()
    if store is None:
        return
    text = f"rank {dist.get_rank()} raised {type(error).__name__}: {error}"[:_MESSAGE_LIMIT]
    with contextlib.suppress(Exception):  # best effort by design
        store.compare_set(FAILURE_KEY, "", text)  # sets only where the key is absent: the first failure wins


def failure_of_peer() -> str | None:
    """The recorded failure of another rank ("rank N raised Type: message"), or None (none recorded, or no store)."""
    store = default_store()
    if store is None:
        return None
    try:
        if not store.check([FAILURE_KEY]):
            return None
        text = bytes(store.get(FAILURE_KEY)).decode(errors="replace")
    except Exception:  # an unreachable store is not itself the failure being looked for
        return None
    return None if not text or text.startswith(f"rank {dist.get_rank()} ") else text


def install_failure_hook() -> None:
    """Make an uncaught exception on this rank print its traceback, record it (`report_failure`) and end the process
    at once, so that every rank stops within moments with this rank's error (idempotent)."""
    if getattr(sys.excepthook, "_cx_failure_hook", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        try:
            previous(kind, error, trace)
        except Exception:  # the traceback must not be lost to a broken hook
            traceback.print_exception(kind, error, trace)
        report_failure(error)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no teardown: a peer blocked on this rank's connections must see them close now

    hook._cx_failure_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook
