"""Where the ranks of a group are when one of its collectives times out: which rank is behind, and at which collective.

A rank's collective log stays in its memory (`_collective_log`) and reaches the job's store (the default group's)
only when something is already slow or failing, never on the hot path:
- a rank whose named wait outlasts its first poll slice (a second) publishes its position under `cx/position/<rank>`
  (its latest record on every group it used, and what it is waiting in), and withdraws it when the wait completes;
- a rank whose collective timed out or failed publishes its position and leaves it there;
- the rank that timed out then reads its peers' positions, waiting up to `REPORT_GRACE` for those not there yet (a
  peer that timed out a moment later), and compares each peer's latest sequence number on the group with its own.
A peer with no position is not waiting in a cx collective: busy elsewhere (compute, I/O, a collective outside cx),
stuck, or gone.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from cx_mesh._collective_log import CollectiveRecord, latest_by_group
from cx_mesh._failures import default_store
from cx_mesh._group_names import group_key, group_ranks

__all__ = ["POSITION_PREFIX", "REPORT_GRACE", "publish_position", "where_ranks_are", "withdraw_position"]

POSITION_PREFIX = "cx/position/"  # + the global rank; the value is JSON: {"state": ..., "groups": {key: record}}
REPORT_GRACE = timedelta(seconds=3)
MOST_PEERS = 64  # peers read per report, so that a timeout on a large group does not flood the store
MOST_LINES = 8  # peers described one by one; the rest are counted
_POLL_S = 0.1
_ABSENT = "\x00absent"  # compare_set's answer for a key that is not there: read without ever blocking


@dataclass(frozen=True)
class _Position:
    state: str  # e.g. "is waiting in all-reduce on group ...", "timed out in ..."
    latest: dict[str, CollectiveRecord]


def publish_position(state: str) -> None:
    """Put this rank's latest record on every group, and `state` (what it is doing), in the store (best effort)."""
    store = default_store()
    if store is None:
        return
    groups = {key: list(record[1:]) for key, record in latest_by_group().items()}
    with contextlib.suppress(Exception):  # an unreachable store only costs the report
        store.set(_key(dist.get_rank()), json.dumps({"state": state, "groups": groups}))


def withdraw_position() -> None:
    """Remove this rank's published position: its slow wait completed, so the position is no longer where it is."""
    store = default_store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.delete_key(_key(dist.get_rank()))


def where_ranks_are(group: dist.ProcessGroup | None, grace: timedelta = REPORT_GRACE) -> list[str]:
    """Lines saying where the other ranks of `group` are against this rank (which should have published its own
    position first, so that peers doing the same can read it)."""
    store = default_store()
    if store is None:
        return []
    me = dist.get_rank()
    peers = [rank for rank in group_ranks(group) if rank != me]
    positions = _read_positions(store, peers[:MOST_PEERS], grace)
    key = group_key(group)
    mine = latest_by_group().get(key)
    lines, silent = [], []
    for rank in peers[:MOST_PEERS]:
        position = positions.get(rank)
        if position is None:
            silent.append(rank)
        else:
            lines.append(_compare(rank, position, position.latest.get(key), mine))
    text = lines[:MOST_LINES]
    if len(lines) > MOST_LINES:
        text.append(f"... and {len(lines) - MOST_LINES} more rank(s) that said where they are")
    if silent:
        text.append(
            f"rank(s) {silent} did not say where they are within {grace.total_seconds():g} s: not waiting in a cx "
            "collective (busy elsewhere: compute, I/O, a collective outside cx; stuck; or ended)"
        )
    if len(peers) > MOST_PEERS:
        text.append(f"{len(peers) - MOST_PEERS} more rank(s) of this group not read")
    return text


def _compare(rank: int, position: _Position, theirs: CollectiveRecord | None, mine: CollectiveRecord | None) -> str:
    """One line: where `rank` is on this group against this rank, and what it is doing now."""
    now = f"rank {rank} {position.state}"
    if theirs is None:
        return f"rank {rank} has issued no collective on this group ({now})"
    if mine is None:
        return f"rank {rank}'s last collective on this group was {theirs.describe()} ({now})"
    if theirs.sequence < mine.sequence:
        return (
            f"rank {rank} is behind: its last collective on this group was {theirs.describe()}, this rank is at "
            f"{mine.describe()} ({now})"
        )
    if theirs.sequence > mine.sequence:
        return f"rank {rank} is ahead: at {theirs.describe()}, this rank at {mine.describe()} ({now})"
    if theirs[2:] != mine[2:]:
        return (
            f"rank {rank} is at {theirs.describe()} where this rank is at {mine.describe()}: the ranks run different "
            f"collectives (out of step; {now})"
        )
    return f"rank {rank} is at the same collective, {theirs.describe()} ({now})"


def _read_positions(store: Any, ranks: list[int], grace: timedelta) -> dict[int, _Position]:
    """The published positions of `ranks`, waiting up to `grace` for those not published yet."""
    deadline = time.monotonic() + grace.total_seconds()
    found: dict[int, _Position] = {}
    while True:
        for rank in ranks:
            if rank in found:
                continue
            try:  # compare_set with an impossible expected value reads a key without waiting for it to exist
                value = bytes(store.compare_set(_key(rank), _ABSENT, _ABSENT)).decode(errors="replace")
            except Exception:  # an unreachable store: report what was read
                return found
            if value != _ABSENT:
                parsed = _parse(value)
                if parsed is not None:
                    found[rank] = parsed
        if len(found) == len(ranks) or time.monotonic() >= deadline:
            return found
        time.sleep(_POLL_S)


def _parse(value: str) -> _Position | None:
    try:
        data = json.loads(value)
        latest = {key: CollectiveRecord(key, *fields) for key, fields in data["groups"].items()}
        return _Position(str(data["state"]), latest)
    except (ValueError, KeyError, TypeError):
        return None


def _key(rank: int) -> str:
    return f"{POSITION_PREFIX}{rank}"
