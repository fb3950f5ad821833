"""Collective timeouts: every group cx creates uses the job's configured timeout, and a timed-out collective says
which group it was.

torch's `new_group` without a timeout falls back to the backend's default (30 minutes for gloo), not to the timeout
the job was launched with, so a stuck or out-of-step rank would hang cx's reductions far longer than the user asked.
`launch` records its timeout here; groups are created with it. A backend's timeout error names a socket or a buffer,
not a group: `named_collective` turns it into a `CollectiveTimeoutError` naming the group, its ranks and the operation.
A peer that failed is not waited for: its closed connection, or the failure it recorded in the store (`_failures`),
becomes a `PeerFailedError` naming it; `wait_named` waits for a gloo collective in short slices and checks the store
between them. A timeout's message also says where the group's other ranks are: which one is behind, at which
collective (`_peer_positions`, from each rank's `_collective_log`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from cx_mesh._failure_messages import peer_failed_message, peer_gone_message, timed_out_message
from cx_mesh._failures import PeerFailedError, failure_of_peer
from cx_mesh._group_names import describe_group
from cx_mesh._peer_positions import publish_position, withdraw_position

__all__ = [
    "CollectiveTimeoutError",
    "collective_timeout",
    "is_timeout_error",
    "is_peer_gone_error",
    "named_collective",
    "set_collective_timeout",
    "wait_named",
]

_configured: timedelta | None = None
_by_group_name: dict[str, timedelta] = {}  # timeouts of the groups cx created, for error messages
# Phrases the backends use when a collective ran out of time (gloo: "Timed out waiting 2000ms for recv operation";
# NCCL's watchdog: "Watchdog caught collective operation timeout"; store waits: "Socket Timeout").
_TIMEOUT_PHRASES = ("timed out", "timeout")
# Phrases of a peer whose process ended (gloo: "Connection closed by peer"; sockets: reset, broken pipe).
_GONE_PHRASES = ("connection closed", "connection reset", "broken pipe")
#: How long a gloo collective is waited for between looks at the store for a failed peer. A slice that runs out
#: costs nothing and leaves the collective in flight (gloo's `Work.wait(timeout)`; measured on torch 2.13).
POLL_SLICE = timedelta(seconds=1)
_SLICE_EXPIRED = "operation timed out!"  # what `Work.wait(timeout)` says when only the slice ran out


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the job's timeout: some rank of the named group is stuck or out of step."""


def set_collective_timeout(timeout: timedelta) -> None:
    """Record the timeout that every group cx creates from now on must use (`launch` calls this)."""
    if timeout <= timedelta(0):
        raise ValueError(f"the collective timeout must be positive, got {timeout}")
    global _configured
    _configured = timeout


def collective_timeout() -> timedelta:
    """The timeout for new groups: the one given to `launch`, else the default group's, else torch's default."""
    if _configured is not None:
        return _configured
    if dist.is_available() and dist.is_initialized():
        found = _default_group_timeout()
        if found is not None:
            return found
    return dist.default_pg_timeout


def _default_group_timeout() -> timedelta | None:
    """The timeout the user gave `init_process_group` directly (no public accessor in torch; best effort)."""
    from torch.distributed import distributed_c10d

    group = distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def remember_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """Note the timeout a group was created with, so that its timeout error can say how long it waited."""
    _by_group_name[group.group_name] = timeout


def group_timeout(group: dist.ProcessGroup | None) -> timedelta:
    """The timeout of a group cx created, else the job's."""
    known = _by_group_name.get(group.group_name) if group is not None else None
    return known if known is not None else collective_timeout()


def is_timeout_error(error: BaseException) -> bool:
    """Whether a backend error reports a collective that ran out of time."""
    text = str(error).lower()
    return isinstance(error, RuntimeError | dist.DistBackendError) and any(p in text for p in _TIMEOUT_PHRASES)


def is_peer_gone_error(error: BaseException) -> bool:
    """Whether a backend error reports that a peer's process ended (its connection closed)."""
    text = str(error).lower()
    return isinstance(error, RuntimeError | dist.DistBackendError) and any(p in text for p in _GONE_PHRASES)


def peer_failed(what: str, group: dist.ProcessGroup | None, failed: str) -> PeerFailedError:
    """The error of a collective that cannot complete because a peer recorded a failure (`failed`)."""
    return PeerFailedError(peer_failed_message(what, group, failed))


@contextlib.contextmanager
def named_collective(what: str, group: dist.ProcessGroup | None) -> Iterator[None]:
    """Run (or wait for) a collective; a backend timeout becomes a `CollectiveTimeoutError` naming `group`, and a
    failed peer (one that recorded its failure, or whose connection closed) a `PeerFailedError` naming it."""
    try:
        yield
    except (CollectiveTimeoutError, PeerFailedError):
        raise
    except Exception as error:
        timed_out, gone = is_timeout_error(error), is_peer_gone_error(error)
        if not timed_out and not gone:
            raise
        failed = failure_of_peer()
        if failed is not None:
            raise peer_failed(what, group, failed) from error
        if gone:
            raise PeerFailedError(peer_gone_message(what, group, error)) from error
        raise CollectiveTimeoutError(timed_out_message(what, group, group_timeout(group), error)) from error


def wait_named(work: dist.Work, what: str, group: dist.ProcessGroup | None) -> None:
    """Wait for a collective in flight under `named_collective`. On gloo it waits in `POLL_SLICE`s and looks for a
    peer's recorded failure between them, so a failed peer is noticed within about a second; a peer that is alive
    but slow is waited for until the group's own timeout. Not for point-to-point work: a gloo send or receive whose
    wait runs out is closed for good (those are waited for once; a failed peer's exit closes them at once)."""
    with named_collective(what, group):
        if dist.get_backend(group) != "gloo":
            work.wait()  # NCCL: torch's watchdog ends a collective that a failed peer left (at the group timeout)
            return
        published = False
        while True:
            try:
                work.wait(POLL_SLICE)
                break
            except Exception as error:
                if _SLICE_EXPIRED not in str(error).lower():
                    raise  # the collective itself failed (its own timeout included): named above
            failed = failure_of_peer()
            if failed is not None:
                raise peer_failed(what, group, failed)
            if not published:  # slow already: say where this rank is, for a peer whose collective times out
                publish_position(f"is waiting in {what} on {describe_group(group)}")
                published = True
        if published:
            withdraw_position()
