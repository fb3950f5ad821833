"""Version-tolerant wrappers for the flat collectives ZeRO uses (all-gather and reduce-scatter into one tensor).

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `*_single` and warns on the old names;
torch 2.4 has only the old names. These wrappers pick whichever exists.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cx_mesh import ProcessGroup

__all__ = ["all_gather_flat", "group_ranks", "reduce_scatter_flat"]

_ALL_GATHER: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None, async_op: bool = False
) -> dist.Work | None:
    """Gather every rank's equally sized `shard` into `output` (rank order, concatenated)."""
    work: dist.Work | None = _ALL_GATHER(output, shard, group=group, async_op=async_op)
    return work


def reduce_scatter_flat(
    output: torch.Tensor, flat: torch.Tensor, group: ProcessGroup | None, async_op: bool = False
) -> dist.Work | None:
    """Sum `flat` (group size x len(output)) over the group; rank r receives the r-th slice in `output`."""
    work: dist.Work | None = _REDUCE_SCATTER(output, flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return work


def group_ranks(group: ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of `group` (the default group when None)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))
