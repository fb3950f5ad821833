"""Starting test processes and collecting their reports within a deadline, whatever the processes do.

Processes come from a forkserver that has imported torch once, so a rank starts in tens of milliseconds instead of
re-importing torch. Waiting watches every rank's report pipe and its process sentinel together: a report, an early
exit and a missed deadline are each told apart and named by rank, and every process is gone when a failure returns.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess

from cx_mesh.testing._worker import Outcome

__all__ = ["DistributedTestFailure", "RankHandle", "collect", "context", "kill_all"]

_FAILURE_GRACE_SECONDS = 3.0
_context: BaseContext | None = None


class DistributedTestFailure(AssertionError):
    """A multi-process test failed: some rank raised, exited early or did not finish in time."""


def context() -> BaseContext:
    """The multiprocessing context for test ranks: a forkserver preloaded with torch (spawn-safe, fork-fast)."""
    global _context
    if _context is None:
        forkserver = multiprocessing.get_context("forkserver")
        forkserver.set_forkserver_preload(["torch", "torch.distributed", "cx_mesh.testing._worker"])
        _context = forkserver
    return _context


@dataclass
class RankHandle:
    rank: int
    process: BaseProcess
    report: multiprocessing.connection.Connection


def kill_all(handles: Sequence[RankHandle]) -> None:
    """Kill every process still alive and reap them all (no process is left behind)."""
    for handle in handles:
        if handle.process.is_alive():
            handle.process.kill()
    for handle in handles:
        handle.process.join(timeout=10)
        handle.report.close()


def _describe(outcomes: dict[int, Outcome], exits: dict[int, int | None], missing: list[int], why: str) -> str:
    parts = [why]
    failed = [rank for rank, outcome in outcomes.items() if not outcome.ok]  # arrival order: first is likeliest cause
    for rank in failed:
        parts.append(f"--- rank {rank} raised:\n{outcomes[rank].error}")
    for rank, code in exits.items():
        parts.append(f"--- rank {rank} exited with code {code} before reporting a result")
    if missing:
        parts.append(f"--- rank(s) {missing} did not finish (still running when stopped; killed)")
    return "\n".join(parts)


def collect(handles: Sequence[RankHandle], timeout: float, what: str) -> dict[int, Outcome]:
    """Wait for one report per rank. Raise `DistributedTestFailure` (after killing every rank) on any problem.

    After the first failure the other ranks get a short grace period to report (their tracebacks help), then
    everything still running is killed.
    """
    deadline = time.monotonic() + timeout
    outcomes: dict[int, Outcome] = {}
    exits: dict[int, int | None] = {}
    by_connection = {handle.report: handle for handle in handles}
    by_sentinel = {handle.process.sentinel: handle for handle in handles}
    pending = {handle.rank for handle in handles}
    while pending:
        failed = any(not o.ok for o in outcomes.values()) or bool(exits)
        if failed:
            deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_SECONDS)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        waitables: list[object] = [h.report for h in handles if h.rank in pending]
        waitables += [h.process.sentinel for h in handles if h.rank in pending]
        for ready in multiprocessing.connection.wait(waitables, timeout=remaining):  # type: ignore[arg-type]
            if isinstance(ready, int):
                handle = by_sentinel[ready]
                if handle.rank not in pending:
                    continue
                if handle.report.poll():  # reported just before exiting
                    continue
                exits[handle.rank] = handle.process.exitcode
                pending.discard(handle.rank)
            else:
                handle = by_connection[ready]  # type: ignore[index]
                if handle.rank not in pending:
                    continue
                try:
                    outcome = handle.report.recv()
                except EOFError:
                    handle.process.join(timeout=1)
                    exits[handle.rank] = handle.process.exitcode
                else:
                    outcomes[handle.rank] = outcome
                pending.discard(handle.rank)
    missing = sorted(pending)
    if missing or exits or any(not o.ok for o in outcomes.values()):
        kill_all(handles)
        if missing and not exits and all(o.ok for o in outcomes.values()):
            why = f"{what}: timed out after {timeout:.0f}s; rank(s) {missing} did not finish"
        else:
            why = f"{what}: failed"
        raise DistributedTestFailure(_describe(outcomes, exits, missing, why))
    return outcomes
