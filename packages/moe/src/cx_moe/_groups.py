"""Checks of an expert-parallel layout before any collective depends on it: a wrong one fails on every rank with
a message naming the sizes, instead of hanging in the first all-to-all."""

from __future__ import annotations

import torch.distributed as dist

from cx_mesh import ProcessGroup, assert_same_across_ranks

__all__ = ["check_expert_groups"]


def _ranks(group: ProcessGroup) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def check_expert_groups(
    num_experts: int, ep_group: ProcessGroup | None, moe_dp_group: ProcessGroup | None, what: str
) -> tuple[int, int]:
    """(ep_rank, ep_size) after checking that `num_experts` splits evenly over `ep_group`, that this rank belongs
    to both groups, that they meet only in this rank (a moe-dp group holds one copy of each slice), and that every
    ep rank agrees on the layout (a collective over `ep_group`)."""
    if ep_group is None:
        if moe_dp_group is not None and not dist.is_initialized():
            raise RuntimeError(f"{what}: a moe_dp_group needs torch.distributed to be initialised")
        return 0, 1
    if not dist.is_initialized():
        raise RuntimeError(f"{what}: an ep_group needs torch.distributed to be initialised")
    me = dist.get_rank()
    ep_ranks = _ranks(ep_group)
    if me not in ep_ranks:
        raise ValueError(f"{what}: rank {me} is not in the ep_group it was given (ranks {ep_ranks})")
    ep_size = len(ep_ranks)
    if num_experts % ep_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"{what}: num_experts={num_experts} does not split over ep_size={ep_size}; ep sizes that work: {divisors}"
        )
    if moe_dp_group is not None:
        dp_ranks = _ranks(moe_dp_group)
        if me not in dp_ranks:
            raise ValueError(f"{what}: rank {me} is not in the moe_dp_group it was given (ranks {dp_ranks})")
        shared = sorted(set(ep_ranks) & set(dp_ranks))
        if shared != [me]:
            raise ValueError(
                f"{what}: ep_group {ep_ranks} and moe_dp_group {dp_ranks} must meet only in this rank ({me}), "
                f"they share {shared}: experts are split over ep and replicated over moe-dp"
            )
    assert_same_across_ranks((num_experts, ep_size), ep_group, f"{what} (num_experts, ep_size)")
    return dist.get_rank(ep_group), ep_size
