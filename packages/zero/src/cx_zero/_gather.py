"""`GroupGatherer`: after a step, all-gathers each rank's updated shards back into the full working parameters.

One all-gather per bucket (the same buckets as the gradient reduction). With `async_op` the gathers are started and
completed later (`overlap_allgather`): all of them just before the first module forward that follows the step, or
when the optimizer needs the parameters, whichever comes first.

With `fp8` the gather goes through `cx_mesh.fp8` (each rank's updated slice as E4M3 with its scale): every rank,
the slice's owner included, takes the dequantized gather as its working parameters, so all replicas stay identical;
the master shards keep full precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import ProcessGroup, all_gather_flat, communication_device
from cx_mesh.fp8 import all_gather_flat_fp8
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

    def __init__(
        self, group: ProcessGroup | None, buckets: list[Bucket], working_dtype: torch.dtype, *, fp8: bool = False
    ) -> None:
        self.group = group
        self.fp8 = fp8
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
            gather = all_gather_flat_fp8 if self.fp8 else all_gather_flat
            work = gather(out, mine, self.group, async_op=async_op)
            pending.append(PendingGather(bucket, self.size, out, work))
        return pending


class DeferredGathers:
    """Started all-gathers, finished together before the next forward reads any parameter, or on demand.

    Finishing only the buckets of the parameters a module owns directly is not enough: a forward may read parameters
    of submodules it never calls (`nn.MultiheadAttention` hands `out_proj.weight` to functional code) or of any other
    module (tied weights, functional models), and nothing cheaper than intercepting every op can tell which. So the
    first forward pre-hook of any module after the step finishes all of them; the gathers overlap with everything
    between `step()` and that forward (zero_grad, the data loader, the scheduler, logging). A process-wide pre-hook
    is registered only while gathers are pending and removed as it fires.
    """

    def __init__(self) -> None:
        self._pending: list[PendingGather] = []
        self._handle: torch.utils.hooks.RemovableHandle | None = None

    def defer(self, pending: list[PendingGather]) -> None:
        self._pending.extend(pending)
        if self._pending and self._handle is None:
            self._handle = nn.modules.module.register_module_forward_pre_hook(self._before_forward)

    def _before_forward(self, _module: nn.Module, _args: Any) -> None:
        self.finish_all()

    def finish_all(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        pending, self._pending = self._pending, []
        for item in pending:
            item.finish()
