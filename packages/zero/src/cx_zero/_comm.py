"""The all-gather of one rank's flat slice into a full CPU copy, from which both halves' state dicts
(LowLevelZero's optimizer state, Gemini's chunks) are built. The flat collectives themselves are cx-mesh's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cx_mesh import ProcessGroup, all_gather_flat, communication_device

__all__ = ["gather_to_cpu", "group_ranks"]


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
