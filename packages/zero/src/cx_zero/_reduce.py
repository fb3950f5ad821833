"""`GroupReducer`: reduces one process group's gradients bucket by bucket into each rank's gradient shards.

Both stages reduce-scatter a bucket (each keeps only its row); stage 1 at the end of backward, stage 2 as soon as
the bucket is complete. Same collective on the same layout, so their results are bit-identical. Gradients are
divided by the number of data-parallel replicas before the sum (as DDP does), summed in the communication dtype
and accumulated into the shard in the master dtype. A parameter without a gradient on this rank contributes zeros.
Each bucket carries one extra column per parameter holding, in every row, whether this rank produced a gradient
for it; after the sum every rank of the group knows whether any rank did (no separate collective). With
`extra_group`, the reduced shard is also all-reduced over that group (replicas of the same partition, e.g. a
second data-parallel dimension).

With `fp8`, both collectives go through `cx_mesh.fp8` (E5M2 payload, one float32 scale per destination row). A
flag then carries its row's largest gradient magnitude instead of 1 (1 in an all-zero row): a value that is the row's
own amax survives the row's quantization, where 1 next to large gradients could round to zero. A NaN flag (an
inf/NaN gradient poisons its whole row) counts as used, so fp16 overflow detection still sees the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cx_mesh import ProcessGroup, all_reduce, communication_device, reduce_scatter_flat
from cx_mesh.fp8 import all_reduce_fp8, reduce_scatter_flat_fp8
from cx_zero._buckets import Bucket
from cx_zero._options import ZeroStage
from cx_zero._partition import ParamShard, padded_flat

__all__ = ["GroupReducer"]


@dataclass(eq=False)
class _InFlight:
    bucket: Bucket
    flat: torch.Tensor
    out: torch.Tensor
    work: dist.Work | None


class GroupReducer:
    """Launches bucket reductions strictly in plan order (as soon as a bucket is complete, or at `flush`)."""

    def __init__(
        self,
        group: ProcessGroup | None,
        buckets: list[Bucket],
        stage: ZeroStage,
        communication_dtype: torch.dtype,
        master_dtype: torch.dtype,
        master_device: torch.device,
        extra_group: ProcessGroup | None = None,
        *,
        fp8: bool = False,
    ) -> None:
        self.group = group
        self.fp8 = fp8
        self.buckets = buckets
        self.stage = stage
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.communication_dtype = communication_dtype
        self.master_dtype = master_dtype
        self.master_device = master_device
        self.extra_group = extra_group
        self.replicas = self.size * (dist.get_world_size(extra_group) if extra_group is not None else 1)
        self.device = communication_device(group)
        self._next = 0
        self._in_flight: list[_InFlight] = []

    def mark_ready(self, shard: ParamShard, launch: bool) -> None:
        """Record that `shard`'s gradient is final for this backward; with `launch`, start every bucket now due and
        accumulate those already finished (never blocking: a rank waiting here on one group while its peer waits on
        another group would deadlock when experts and dense parameters use different groups)."""
        self.buckets[shard.bucket].ready.add(shard.index)
        if launch:
            while self._next < len(self.buckets) and self.buckets[self._next].complete:
                self._launch(self.buckets[self._next], async_op=True)
                self._next += 1
            # Completing a bucket all-reduces it over `extra_group`, a blocking collective: only at `flush`.
            while (
                self.extra_group is None
                and self._in_flight
                and (self._in_flight[0].work is None or self._in_flight[0].work.is_completed())
            ):
                self._complete(self._in_flight.pop(0))

    def flush(self) -> None:
        """Launch every bucket not yet launched (in order), wait for all and accumulate the shards."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next], async_op=True)
            self._next += 1
        for item in self._in_flight:
            self._complete(item)
        self._in_flight.clear()
        self._next = 0
        for bucket in self.buckets:
            bucket.ready.clear()

    def _launch(self, bucket: Bucket, async_op: bool) -> None:
        columns = bucket.width + len(bucket.shards)
        flat = torch.zeros(self.size, columns, dtype=self.communication_dtype, device=self.device)
        for shard in bucket.shards:
            grad = shard.working.grad
            if grad is not None:
                rows = padded_flat(grad.detach(), self.size).view(self.size, shard.shard_numel)
                flat[:, shard.offset : shard.offset + shard.shard_numel].copy_(rows)
                shard.working.grad = None
        used = [bucket.width + i for i, shard in enumerate(bucket.shards) if shard.used]
        if used:
            flat[:, used] = self._flag_values(flat[:, : bucket.width])
        if self.replicas > 1:
            flat.div_(self.replicas)
        work: dist.Work | None = None
        if self.size == 1:
            out = flat[0]
        else:  # both stages keep only this rank's row: a reduce-scatter moves half the bytes of an all-reduce
            out = torch.empty(columns, dtype=self.communication_dtype, device=self.device)
            reduce = reduce_scatter_flat_fp8 if self.fp8 else reduce_scatter_flat
            work = reduce(out, flat.view(-1), dist.ReduceOp.SUM, self.group, async_op=async_op)
        self._in_flight.append(_InFlight(bucket, flat, out, work))

    def _flag_values(self, grads: torch.Tensor) -> torch.Tensor | float:
        """What a used parameter's flag column holds in each row: 1, or under fp8 the row's amax (1 if zero)."""
        if not self.fp8:
            return 1.0
        amax = grads.abs().amax(dim=1, keepdim=True)
        return torch.where(amax > 0, amax, torch.ones_like(amax))

    def _complete(self, item: _InFlight) -> None:
        if item.work is not None:
            item.work.wait()
        out = item.out
        if self.extra_group is not None and dist.get_world_size(self.extra_group) > 1:
            out = out.to(communication_device(self.extra_group))
            (all_reduce_fp8 if self.fp8 else all_reduce)(out, group=self.extra_group)
        out = out.to(device=self.master_device, dtype=self.master_dtype)
        # Views into `out` are kept as they are unless `out` is a row of the whole bucket (stage 1), which must
        # not stay alive for the sake of one row.
        shares_bucket = out.untyped_storage().data_ptr() == item.flat.untyped_storage().data_ptr()
        width = item.bucket.width
        flags = ~(out[width:] <= 0) if self.fp8 else out[width:] > 0  # fp8: a NaN flag counts (see module doc)
        for i, shard in enumerate(item.bucket.shards):
            used = flags[i : i + 1]
            shard.used_anywhere = used if shard.used_anywhere is None else shard.used_anywhere | used
            piece = out[shard.offset : shard.offset + shard.shard_numel]
            if shard.grad_shard is None:
                shard.grad_shard = piece.clone() if shares_bucket else piece
            else:
                shard.grad_shard.add_(piece)
