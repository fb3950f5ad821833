"""`GroupGatherer`: after a step, all-gathers each rank's updated shards back into the full working parameters.

One all-gather per bucket (the same buckets as the gradient reduction). With `async_op` the gathers are started and
completed later, bucket by bucket, just before a module that owns one of the bucket's parameters runs forward
(`overlap_allgather`), or all at once when the optimizer needs the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import ProcessGroup, all_gather_flat, communication_device
from cx_zero._buckets import Bucket

__all__ = ["DeferredGathers", "GroupGatherer", "PendingGather"]


@dataclass(eq=False)
class PendingGather:
    """A started all-gather of one bucket; `finish` copies the result into the working parameters once."""

    bucket: Bucket
    size: int
    out: torch.Tensor
    work: dist.Work | None
    done: bool = False

    def finish(self) -> None:
        if self.done:
            return
        if self.work is not None:
            self.work.wait()
        rows = self.out.view(self.size, self.bucket.width)
        with torch.no_grad():
            for shard in self.bucket.shards:
                full = rows[:, shard.offset : shard.offset + shard.shard_numel].reshape(-1)[: shard.numel]
                shard.working.data.copy_(full.view_as(shard.working))
        self.done = True


class GroupGatherer:
    """Rebuilds the working parameters of one process group from every rank's master shard."""

    def __init__(self, group: ProcessGroup | None, buckets: list[Bucket], working_dtype: torch.dtype) -> None:
        self.group = group
        self.buckets = buckets
        self.size = dist.get_world_size(group)
        self.working_dtype = working_dtype
        self.device = communication_device(group)

    def start(self, async_op: bool) -> list[PendingGather]:
        pending = []
        for bucket in self.buckets:
            # one pass per shard: cast and move straight into the send buffer (no per-shard temporary, no cat)
            mine = torch.empty(bucket.width, dtype=self.working_dtype, device=self.device)
            for s in bucket.shards:
                mine[s.offset : s.offset + s.shard_numel].copy_(s.master.detach())
            if self.size == 1:
                pending.append(PendingGather(bucket, 1, mine, None))
                continue
            out = torch.empty(self.size * bucket.width, dtype=self.working_dtype, device=self.device)
            work = all_gather_flat(out, mine, self.group, async_op=async_op)
            pending.append(PendingGather(bucket, self.size, out, work))
        return pending


class DeferredGathers:
    """Started all-gathers finished lazily: a module's parameters just before its forward, or all at once.

    While any are pending, a process-wide forward pre-hook is registered (and removed as soon as none is left); it
    finishes the buckets holding the parameters the module owns directly.
    """

    def __init__(self) -> None:
        self._by_param: dict[int, PendingGather] = {}
        self._handle: torch.utils.hooks.RemovableHandle | None = None

    def defer(self, pending: list[PendingGather]) -> None:
        for item in pending:
            for shard in item.bucket.shards:
                self._by_param[id(shard.working)] = item
        if self._by_param and self._handle is None:
            self._handle = nn.modules.module.register_module_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: nn.Module, _args: Any) -> None:
        for param in module.parameters(recurse=False):
            item = self._by_param.pop(id(param), None)
            if item is not None:
                item.finish()
        if not self._by_param:
            self.finish_all()

    def finish_all(self) -> None:
        for item in list(self._by_param.values()):
            item.finish()
        self._by_param.clear()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
