"""The flat collectives ZeRO uses beyond cx-mesh's `all_gather_flat`: reduce-scatter into one tensor, and the
all-gather of one rank's flat slice into a full CPU copy that both halves' state dicts (LowLevelZero's optimizer
state, Gemini's chunks) are built from.

torch 2.13 renamed `reduce_scatter_tensor` to `reduce_scatter_single` and warns on the old name; torch 2.4 has only
the old name. The wrapper picks whichever exists (cx-mesh's `all_gather_flat` does the same for the all-gather).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cx_mesh import ProcessGroup, all_gather_flat, communication_device

__all__ = ["gather_to_cpu", "group_ranks", "reduce_scatter_flat"]

_REDUCE_SCATTER: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_flat(
    output: torch.Tensor, flat: torch.Tensor, group: ProcessGroup | None, async_op: bool = False
) -> dist.Work | None:
    """Sum `flat` (group size x len(output)) over the group; rank r receives the r-th slice in `output`."""
    work: dist.Work | None = _REDUCE_SCATTER(output, flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return work


def gather_to_cpu(shard: torch.Tensor, group: ProcessGroup | None, group_size: int) -> torch.Tensor:
    """Every rank's equally sized 1-D `shard` concatenated in rank order, as a fresh CPU tensor (collective over
    `group` unless `group_size` is 1, when `shard` is already the whole)."""
    if group_size == 1:
        return shard.detach().to("cpu", copy=True)
    device = communication_device(group)
    out = torch.empty(shard.numel() * group_size, dtype=shard.dtype, device=device)
    all_gather_flat(out, shard.detach().to(device).contiguous(), group)
    return out.cpu()


def group_ranks(group: ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of `group` (the default group when None)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))
