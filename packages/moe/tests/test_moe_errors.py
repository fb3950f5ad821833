"""Bad expert-parallel layouts fail with a clear message on every rank, before any all-to-all could hang."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from cx_mesh import RankMismatchError
from cx_mesh.testing import PerTestCache, distributed
from cx_moe import ExpertOptions, MoeLayer, RouterOptions
from moe_test_helpers import groups, world

EXPERTS = ExpertOptions(16, 8)


@distributed(world_size=4)
def test_moe_layer_layout_errors(rank: int, world_size: int) -> None:
    ep_group, _moe_dp_group = groups(2)
    with pytest.raises(
        ValueError, match=r"num_experts=6 does not split over ep_size=4; ep sizes that work: \[1, 2, 3, 6\]"
    ):
        MoeLayer(EXPERTS, RouterOptions(6, 2), ep_group=world())
    with pytest.raises(
        ValueError, match=r"ep_group \[.*\] and moe_dp_group \[0, 1, 2, 3\] must meet only in this rank"
    ):
        MoeLayer(EXPERTS, RouterOptions(4, 2), ep_group=ep_group, moe_dp_group=world())
    foreign = _foreign_group(rank)
    with pytest.raises(ValueError, match="is not in the ep_group"):
        MoeLayer(EXPERTS, RouterOptions(4, 2), ep_group=foreign)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=4\], got 5"):
        RouterOptions(4, 5)


_FOREIGN: PerTestCache[int, dist.ProcessGroup] = PerTestCache()


def _foreign_group(rank: int) -> dist.ProcessGroup:
    """A group handle whose members exclude this rank: ranks 0-1 get {2, 3}'s group and vice versa."""
    if not _FOREIGN:
        low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
        _FOREIGN[0], _FOREIGN[1] = high, low
    return _FOREIGN[rank // 2]


@distributed(world_size=2)
def test_ranks_disagreeing_on_the_layer_fail_on_every_rank(rank: int, world_size: int) -> None:
    ep_group, moe_dp_group = groups(2)
    experts = 4 if rank == 0 else 8
    with pytest.raises(RankMismatchError, match="num_experts, ep_size"):
        MoeLayer(EXPERTS, RouterOptions(experts, 2), ep_group=ep_group, moe_dp_group=moe_dp_group)
