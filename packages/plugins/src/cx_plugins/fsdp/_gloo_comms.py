"""FSDP2's collectives on gloo with every buffer released at a fixed point, not by gloo's worker thread.

A gloo collective's work object holds the tensors it was handed and is released by gloo's worker thread after the
caller's wait has returned; where that release is the last reference it frees the storage, and it has to wait for
the GIL to do so (the tensors have Python objects). So whether a buffer was freed before or after the next
allocations depended on thread scheduling: under CPU load cx-plan measured the same TorchFSDP + Muon step at
1,044,972 or 1,192,684 bytes. Two such buffers:
- torch's gloo `reduce_scatter_tensor` clones its whole input (a unit's fp32 gradients), all-reduces the clone and
  copies this rank's chunk out; the clone, owned by the work object alone, outlived the reduce-scatter into FSDP2's
  next unshard. `InPlaceReduceScatter` all-reduces FSDP2's own packed input in place instead (FSDP2 never reads it
  again) and copies the chunk out: the same all-reduce on the same data, so the same sums, and one copy fewer;
- FSDP2's all-gather output, which FSDP2 drops after its copy-out, was at times freed later by the worker thread.
Both run through `_released`: the collective gets fresh views of the tensors and returns only once the backend has
let go of them (their storages' use counts are back), so Python frees them where FSDP2 drops them. Reduce ops gloo
does not run in place here (PREMUL_SUM) and async calls (FSDP2's `unshard_async_op`) go to torch's own collectives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# FSDP2's comm-hook interfaces: public through FSDPModule.set_custom_*, not re-exported by torch.distributed.fsdp
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

__all__ = ["InPlaceReduceScatter", "ReleasedAllGather"]

_RELEASE_WAIT_S = 1.0  # a backend that keeps its work objects longer is left to free them itself


def _released(collective: Callable[..., dist.Work | None], *tensors: torch.Tensor) -> None:
    """Run `collective` (async) on fresh views of `tensors`, wait for it, and return once no view is left with the
    backend; the sleeps hand the GIL to the worker thread that drops them."""
    storages = [t.untyped_storage() for t in tensors]
    before = [torch._C._storage_Use_Count(s._cdata) for s in storages]
    views = [t.view(t.shape) for t in tensors]
    work = collective(*views)
    if work is not None:
        work.wait()
    del work, views
    deadline = time.monotonic() + _RELEASE_WAIT_S
    while time.monotonic() < deadline and any(
        torch._C._storage_Use_Count(s._cdata) > n for s, n in zip(storages, before, strict=True)
    ):
        time.sleep(0)


class InPlaceReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter (SUM or AVG) as an in-place all-reduce of its input and a copy of this rank's chunk."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        average = op == dist.ReduceOp.AVG
        if async_op or not (average or op == dist.ReduceOp.SUM) or not input_tensor.is_contiguous():
            work: dist.Work | None = dist.reduce_scatter_single(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
            return work
        _released(lambda flat: dist.all_reduce(flat, group=group, async_op=True), input_tensor)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        chunk = input_tensor.view(size, -1)[rank].view(output_tensor.shape)
        if average:
            torch.div(chunk, size, out=output_tensor)
        else:
            output_tensor.copy_(chunk)
        return None


class ReleasedAllGather(AllGather):
    """FSDP2's all-gather, returning once gloo has let go of its output."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        if async_op:
            work: dist.Work | None = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True)
            return work

        def gather(output: torch.Tensor, local: torch.Tensor) -> dist.Work | None:
            started: dist.Work | None = dist.all_gather_single(output, local, group=group, async_op=True)
            return started

        _released(gather, output_tensor, input_tensor)
        return None
