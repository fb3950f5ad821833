"""Names for the communication torch runs inside a boosted model's forward and a boosted optimizer's backward and step.

DDP's reducer and FSDP2's hooks issue their collectives inside torch, so a stuck or killed peer used to surface from
`loss.backward()` as a bare gloo error ("Timed out waiting 60000ms for recv", "Connection reset by peer") naming no
group and no rank. The wrappers run each phase that communicates under cx-mesh's `named_collective`, which turns such
an error into a `CollectiveTimeoutError` or `PeerFailedError` naming the phase, the group and this rank, and record
it in cx-mesh's collective log, so that a timeout can also say which rank is behind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from cx_mesh import named_collective, record_collective

__all__ = ["UNNAMED", "NamedPhases"]


@dataclass(frozen=True)
class NamedPhases:
    """What a plugin's forward, backward and step communicate inside torch, and over which group (None: the default
    group); a phase left None communicates nothing there and runs as it is."""

    group: dist.ProcessGroup | None = None
    forward: str | None = None
    backward: str | None = None
    step: str | None = None

    @contextlib.contextmanager
    def during(self, what: str | None) -> Iterator[None]:
        """Run a phase described by `what` (one of the fields above, or the plugin's own words) named and logged."""
        if what is None:
            yield
            return
        record_collective(what, self.group)
        with named_collective(what, self.group):
            yield

    def __deepcopy__(self, memo: dict[int, Any]) -> NamedPhases:
        return self  # a process group is a handle of this process, not data: copies of a model share it

    def __copy__(self) -> NamedPhases:
        return self


UNNAMED = NamedPhases()
