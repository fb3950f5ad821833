"""The process group over which the writer threads of asynchronous hybrid saves exchange their statuses.

`write_sharded` over a group ends each phase with a status exchange, so the write job of a hybrid save is collective
even on the writer thread. It cannot use the training's groups: the training thread keeps issuing its own
collectives on those, and two threads issuing collectives on one group pair them up differently on each rank. A gloo
group of its own, over every rank and used by the writer threads alone, keeps the two apart (gloo whatever the
training backend: the exchanges are a few bytes on the CPU). Every rank queues the same jobs in the same order (a
hybrid save is collective), so the writer threads of all ranks meet in the same exchanges.
"""

from __future__ import annotations

import torch.distributed as dist

from cx_mesh import ProcessGroup, collective_timeout

__all__ = ["WriterGroup"]


class WriterGroup:
    """Created on first use (collective over the world: every rank asks at the same save), then kept."""

    def __init__(self) -> None:
        self._group: ProcessGroup | None = None

    def get(self) -> ProcessGroup:
        if self._group is None:
            group = dist.new_group(backend="gloo", timeout=collective_timeout(), group_desc="cx checkpoint writer")
            if group is None:  # only for a rank outside the group; this one spans the world
                raise RuntimeError("the checkpoint writer group was not created on this rank")
            self._group = group
        return self._group
