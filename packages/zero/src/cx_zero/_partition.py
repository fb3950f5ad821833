"""How one parameter is split over its data-parallel group: flattened, padded to a multiple of the group size,
cut into equal slices; rank r of the group owns slice r (its master weight, optimizer state and reduced gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ParamShard", "padded_flat", "shard_of"]


def padded_flat(tensor: torch.Tensor, group_size: int) -> torch.Tensor:
    """`tensor` flattened and zero-padded to a multiple of `group_size` elements."""
    flat = tensor.reshape(-1)
    padding = (-flat.numel()) % group_size
    return F.pad(flat, (0, padding)) if padding else flat


def shard_of(tensor: torch.Tensor, group_size: int, group_rank: int) -> torch.Tensor:
    """This rank's slice of `tensor` (a view when no padding was needed)."""
    flat = padded_flat(tensor, group_size)
    size = flat.numel() // group_size
    return flat[group_rank * size : (group_rank + 1) * size]


@dataclass(eq=False)
class ParamShard:
    """One working parameter, its master shard and its place in the partition and in the gradient buckets."""

    index: int
    key: str
    working: torch.nn.Parameter
    master: torch.Tensor
    group_index: int
    group_size: int
    group_rank: int
    bucket: int = -1
    offset: int = 0
    grad_shard: torch.Tensor | None = None
    used: bool = False
    used_anywhere: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.working.numel()

    @property
    def shard_numel(self) -> int:
        return -(-self.working.numel() // self.group_size)

    @property
    def padding(self) -> int:
        return self.shard_numel * self.group_size - self.working.numel()
