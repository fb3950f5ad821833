"""Process groups with nothing to communicate: one replica (group size 1, no `extra_dp_group` beyond one rank).

MoE builds such a group for the experts whenever `moe_dp` is 1. There the general path would still zero a flat bucket
every step, copy each gradient into it, clone the row back out and copy the master through a send buffer into the
parameter, for a reduction over one rank and a gather of one shard. Here instead:
- `LocalReducer` takes each parameter's accumulated `.grad` as its gradient shard (a view when dtypes and devices
  agree: averaging over one replica is the identity), after the same cast to the communication dtype the bucket
  would have applied, so results are bit-identical to the general path.
- `local_master` makes the working parameter itself the master (a flat view of its storage) when this rank's shard
  is the whole parameter in the master dtype on its own device: the optimizer steps the parameter in place, with no
  second copy in memory. Otherwise (mixed precision, `cpu_offload`) the master is a separate copy as usual.
- `LocalGatherer` then has nothing to gather: it copies a separate master into the parameter, and nothing at all for
  a master that is the parameter (unless the parameter's storage was replaced since, e.g. `param.data = ...`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cx_zero._buckets import Bucket
from cx_zero._gather import PendingGather
from cx_zero._partition import ParamShard, shard_of

__all__ = ["LocalGatherer", "LocalReducer", "is_alias", "local_master"]


def local_master(
    param: torch.Tensor, dtype: torch.dtype, device: torch.device, alias: bool, size: int, rank: int
) -> torch.Tensor:
    """The master shard of `param`: a flat view of the parameter itself when `alias` is allowed (one replica, no
    offload) and nothing needs converting, else a fresh copy of this rank's slice in `dtype` on `device`."""
    if alias and size == 1 and param.dtype == dtype and param.device == device and param.is_contiguous():
        return param.data.view(-1)
    return shard_of(param.detach(), size, rank).to(device=device, dtype=dtype).clone()


def is_alias(shard: ParamShard) -> bool:
    """Whether `shard.master` is (still) the working parameter's own memory."""
    working = shard.working.data
    return shard.master.data_ptr() == working.data_ptr() and shard.master.numel() == working.numel()


class LocalReducer:
    """The `GroupReducer` of a one-replica group: no bucket, no collective, the gradient used where it is."""

    def __init__(
        self,
        shards: Sequence[ParamShard],
        communication_dtype: torch.dtype,
        master_dtype: torch.dtype,
        master_device: torch.device,
    ) -> None:
        self.shards = list(shards)
        self.communication_dtype = communication_dtype
        self.master_dtype = master_dtype
        self.master_device = master_device
        # whether a parameter took part is known locally: one constant flag per answer, on the master device
        self._used = torch.ones(1, dtype=torch.bool, device=master_device)
        self._unused = torch.zeros(1, dtype=torch.bool, device=master_device)

    def mark_ready(self, shard: ParamShard, launch: bool) -> None:
        """Nothing to launch early: the gradient is taken at `flush`."""

    def flush(self) -> None:
        """Move each accumulated `.grad` into the gradient shard (added to one left by an earlier backward)."""
        for shard in self.shards:
            grad = shard.working.grad
            if grad is not None:
                shard.working.grad = None
                # the bucket's rounding to the communication dtype, then the shard's master dtype (no-ops when equal)
                piece = grad.detach().to(self.communication_dtype).reshape(-1)
                piece = piece.to(device=self.master_device, dtype=self.master_dtype)
                if shard.grad_shard is None:
                    shard.grad_shard = piece
                else:
                    shard.grad_shard.add_(piece)
            shard.used_anywhere = self._used if shard.used else self._unused


class LocalGatherer:
    """The `GroupGatherer` of a one-replica group: copies only masters that are not the parameter itself."""

    def __init__(self, shards: Sequence[ParamShard]) -> None:
        self.shards = list(shards)
        self.buckets: list[Bucket] = []  # as `GroupGatherer` has: none here, nothing is communicated

    def start(self, async_op: bool) -> list[PendingGather]:
        """Update the working parameters now (a local copy, nothing worth deferring); returns no pending work."""
        with torch.no_grad():
            for shard in self.shards:
                if not is_alias(shard):
                    shard.working.data.copy_(shard.master.view_as(shard.working))
        return []
