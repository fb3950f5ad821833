"""Capacity: how many assignments each expert accepts from one rank's batch, and which ones it keeps.

Every (token, slot) assignment gets a rank among the assignments to the same expert, in priority order: by routing
weight, highest first (`DropPolicy.PROBABILITY`, ties broken by position), or by position in the batch
(`DropPolicy.POSITION`: token 0's slots, then token 1's, ...). Assignments ranked below `capacity` are kept; their
rank is also their slot in a padded `[expert, capacity]` buffer.
"""

from __future__ import annotations

import math

import torch

from cx_moe._options import CapacityOptions, DropPolicy

__all__ = ["expert_capacity", "rank_within_expert"]


def expert_capacity(options: CapacityOptions, num_tokens: int, top_k: int, num_experts: int) -> int:
    """`max(min_capacity, ceil(capacity_factor * num_tokens * top_k / num_experts))`."""
    return max(options.min_capacity, math.ceil(options.capacity_factor * num_tokens * top_k / num_experts))


def rank_within_expert(
    weights: torch.Tensor, indices: torch.Tensor, num_experts: int, policy: DropPolicy
) -> torch.Tensor:
    """[T, k] int64: each assignment's 0-based priority rank among the assignments to its expert."""
    flat_experts = indices.reshape(-1)
    total = flat_experts.numel()
    if policy is DropPolicy.PROBABILITY:
        priority = torch.argsort(weights.detach().reshape(-1), descending=True, stable=True)
    else:
        priority = torch.arange(total, device=indices.device)
    experts_in_priority = flat_experts[priority]
    by_expert = torch.argsort(experts_in_priority, stable=True)  # priority order kept within each expert
    counts = torch.bincount(flat_experts, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    sorted_experts = experts_in_priority[by_expert]
    rank_sorted = torch.arange(total, device=indices.device) - starts[sorted_experts]
    ranks = torch.empty_like(flat_experts)
    ranks[priority[by_expert]] = rank_sorted
    return ranks.view_as(indices)
