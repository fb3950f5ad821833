"""`DistCoordinator`: who is master, doing work on the master only, and ordered execution across ranks."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch.distributed as dist

from cx_mesh._collectives import ProcessGroup, require_initialized

__all__ = ["DistCoordinator"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class DistCoordinator:
    """Facts about this rank and small coordination patterns over a process group (default: the world). The group
    argument is called `process_group`, as in ColossalAI."""

    def __init__(self) -> None:
        require_initialized("DistCoordinator")
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        self._local_rank = int(os.environ.get("LOCAL_RANK", str(self._rank)))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def is_master(self, process_group: ProcessGroup | None = None) -> bool:
        """True on the first rank of `process_group` (rank 0 of the world by default)."""
        return dist.get_rank(process_group) == 0

    def is_node_master(self) -> bool:
        """True on the first process of this node (LOCAL_RANK 0 under torchrun)."""
        return self._local_rank == 0

    def is_last_process(self, process_group: ProcessGroup | None = None) -> bool:
        return dist.get_rank(process_group) == dist.get_world_size(process_group) - 1

    def block_all(self, process_group: ProcessGroup | None = None) -> None:
        """A barrier over `process_group`."""
        dist.barrier(group=process_group)

    def print_on_master(self, message: str, process_group: ProcessGroup | None = None) -> None:
        if self.is_master(process_group):
            print(message, flush=True)

    def print_on_node_master(self, message: str) -> None:
        """Print on the first process of each node only (LOCAL_RANK 0), e.g. per-node facts like free disk."""
        if self.is_node_master():
            print(message, flush=True)

    def destroy(self, process_group: ProcessGroup | None = None) -> None:
        """Destroy `process_group` (the default group, and with it every group, when None): ColossalAI scripts end with
        `coordinator.destroy()`. Every rank of the group must call it."""
        dist.destroy_process_group(process_group)

    def on_master_only(
        self, process_group: ProcessGroup | None = None
    ) -> Callable[[Callable[_P, _R]], Callable[_P, _R | None]]:
        """Decorator: run the function on the master of `process_group` only; other ranks get None."""

        def decorator(function: Callable[_P, _R]) -> Callable[_P, _R | None]:
            @functools.wraps(function)
            def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
                if self.is_master(process_group):
                    return function(*args, **kwargs)
                return None

            return wrapper

        return decorator

    @contextlib.contextmanager
    def priority_execution(self, executor_rank: int = 0, process_group: ProcessGroup | None = None) -> Iterator[bool]:
        """The executor rank runs the block first, the others after it (e.g. download once, then read).

        Yields True on the executor rank. Ranks are ranks within `process_group`.
        """
        is_executor = dist.get_rank(process_group) == executor_rank
        if not is_executor:
            dist.barrier(group=process_group)
        yield is_executor
        if is_executor:
            dist.barrier(group=process_group)
