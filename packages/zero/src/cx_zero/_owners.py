"""Which rank of a data-parallel group steps each whole parameter: balanced by the cost of its update.

A matrix-wise optimizer's update is dominated by Newton-Schulz (Muon): each iteration multiplies an m x n matrix by
its Gram matrix, about m * n * min(m, n) multiply-adds (a constant number of iterations per step). A 1-D or other
parameter costs about its number of elements. Owners are assigned greedily, most expensive first, each to the rank
with the least total so far (longest-processing-time scheduling: within 4/3 of the best balance); ties go to the lower
rank and the earlier parameter, so every rank computes the same assignment from the same shapes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

__all__ = ["assign_owners", "update_cost"]


def update_cost(shape: torch.Size | Sequence[int]) -> int:
    """Multiply-adds of one Newton-Schulz iteration on a matrix of `shape` (trailing dimensions flattened), or the
    element count of a 0-D / 1-D parameter."""
    dims = list(shape)
    if len(dims) < 2:
        return max(1, dims[0] if dims else 1)
    rows, cols = dims[0], 1
    for size in dims[1:]:
        cols *= size
    return max(1, rows * cols * min(rows, cols))


def assign_owners(shapes: Sequence[torch.Size | Sequence[int]], group_size: int) -> list[int]:
    """The owning group rank of each parameter of `shapes` (same order), costs balanced over `group_size` ranks."""
    if group_size < 1:
        raise ValueError(f"assign_owners: group_size must be at least 1, got {group_size}")
    owners = [0] * len(shapes)
    loads = [(0, rank) for rank in range(group_size)]  # (total cost, rank): a heap, least loaded first
    order = sorted(range(len(shapes)), key=lambda i: (-update_cost(shapes[i]), i))
    for index in order:
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + update_cost(shapes[index]), rank))
    return owners
