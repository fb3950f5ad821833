"""This rank's last collectives, kept in memory so that a timed-out collective can say where each rank is.

Every collective issued through cx-mesh, and every communicating phase a plugin names (DDP's backward, FSDP2's
forward), is recorded as its group, its sequence number on that group (1, 2, ... per group on this rank), its kind
and the size of the tensor it was handed: a ring of the last `RING_SIZE` and the latest per group. Cheap enough to
leave on: a tuple appended to a deque and one dict entry per collective, no lock, no formatting and no store traffic
(benchmarks/mesh). The sequence numbers count what cx recorded on a group, so they agree across the group's ranks
while the ranks run the same program; `_peer_positions` compares them when a collective times out.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch
import torch.distributed as dist

from cx_mesh._group_names import describe_group, group_key

__all__ = [
    "RING_SIZE",
    "CollectiveRecord",
    "clear_collective_log",
    "group_description",
    "last_collectives",
    "latest_by_group",
    "record_collective",
    "set_collective_recording",
]

RING_SIZE = 16


class CollectiveRecord(NamedTuple):
    """One collective this rank issued: group key, its number on that group, kind, elements and dtype handed."""

    group: str
    sequence: int
    kind: str
    numel: int | None = None
    dtype: str | None = None

    def describe(self) -> str:
        """E.g. `#42 all-reduce (4096 float32)`."""
        size = "" if self.numel is None else f" ({self.numel} {self.dtype})"
        return f"#{self.sequence} {self.kind}{size}"


# Entries are plain tuples with CollectiveRecord's fields (a NamedTuple costs a Python-level __new__ per collective).
_Entry = tuple[str, int, str, int | None, str | None]
_ring: deque[_Entry] = deque(maxlen=RING_SIZE)
_latest: dict[str, _Entry] = {}
_descriptions: dict[str, str] = {}  # group key -> describe_group(group), taken at its first collective
_default_key: str | None = None  # the default group's key, looked up once (torch's lookup costs a microsecond)
_enabled = True


def record_collective(kind: str, group: dist.ProcessGroup | None = None, tensor: torch.Tensor | None = None) -> None:
    """Note that this rank issues a collective of `kind` on `group` (handed `tensor`, when it has one). cx-mesh's
    collectives call it; a package whose collective runs inside torch (DDP, FSDP2) calls it where that phase starts."""
    if not _enabled:
        return
    key = group.group_name if group is not None else _default_key or _find_default_key()
    last = _latest.get(key)
    if last is None:
        _descriptions[key] = describe_group(group)
    sequence = 1 if last is None else last[1] + 1
    if tensor is None:
        entry: _Entry = (key, sequence, kind, None, None)
    else:
        entry = (key, sequence, kind, tensor.numel(), _DTYPE_NAMES[tensor.dtype])
    _latest[key] = entry
    _ring.append(entry)


def _find_default_key() -> str:
    global _default_key
    _default_key = group_key(None)
    return _default_key


def last_collectives() -> list[CollectiveRecord]:
    """This rank's last `RING_SIZE` recorded collectives, oldest first."""
    return [CollectiveRecord(*entry) for entry in _ring]


def latest_by_group() -> dict[str, CollectiveRecord]:
    """This rank's latest recorded collective on each group it has used, by group key."""
    return {key: CollectiveRecord(*entry) for key, entry in _latest.items()}


def group_description(key: str) -> str:
    """The human name of the group recorded under `key`."""
    return _descriptions.get(key, f"group {key!r}")


def set_collective_recording(enabled: bool) -> bool:
    """Turn the recording on or off (on by default); returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, enabled
    return previous


def clear_collective_log() -> None:
    """Forget every record (`launch` calls it: a new process group starts its groups' numbering again)."""
    global _default_key
    _default_key = None
    _ring.clear()
    _latest.clear()
    _descriptions.clear()


class _DtypeNames(dict[torch.dtype, str]):
    """`float32` for `torch.float32`, computed once per dtype (formatting a dtype per collective would cost)."""

    def __missing__(self, dtype: torch.dtype) -> str:
        name = self[dtype] = str(dtype).removeprefix("torch.")
        return name


_DTYPE_NAMES = _DtypeNames()
