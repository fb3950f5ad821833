"""`ParallelLayout`: sizes resolved and checked before any collective (errors name the sizes that would work), and
groups, ranks and data coordinates taken from the mesh, matching a hand computation over every rank."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from cx_mesh.testing import distributed
from cx_plugins._layout import FILL, Axis, LayoutError, ParallelLayout, resolve_sizes


def test_resolve_sizes_fills_the_one_inferred_axis() -> None:
    assert resolve_sizes([(Axis.DP, FILL), (Axis.PP, 2), (Axis.TP, 2)], 8) == (2, 2, 2)
    assert resolve_sizes([(Axis.PP, 4), (Axis.DP, FILL), (Axis.TP, 1), (Axis.SP, 1)], 8) == (4, 2, 1, 1)


def test_resolve_sizes_errors_name_the_sizes_that_would_work() -> None:
    only_pp = r"^the world size 8 is not divisible by pp_size = 3; pp_size can be 1, 2, 4 or 8$"
    with pytest.raises(LayoutError, match=only_pp):
        resolve_sizes([(Axis.DP, FILL), (Axis.PP, 3), (Axis.TP, 1)], 8)
    with_tp = r"not divisible by pp\*tp = 3\*2 = 6; pp_size can be 1, 2 or 4 \(with tp_size=2\)"
    with pytest.raises(LayoutError, match=with_tp):
        resolve_sizes([(Axis.DP, FILL), (Axis.PP, 3), (Axis.TP, 2)], 8)
    with pytest.raises(LayoutError, match=r"not equal to ep\*tp = 2\*2 = 4; ep_size can be 1 \(with tp_size=2\)"):
        resolve_sizes([(Axis.EP, 2), (Axis.TP, 2)], 2)
    # the largest axis (tp 4) cannot fit whatever its size (3 does not divide 8): the next one is sized instead
    with pytest.raises(LayoutError, match=r"; pp_size can be 1 or 2 \(with tp_size=4\)$"):
        resolve_sizes([(Axis.DP, FILL), (Axis.PP, 3), (Axis.TP, 4)], 8)
    with pytest.raises(LayoutError, match=r"not divisible by ep\*tp = 4\*4 = 16; launch a multiple of 16 processes$"):
        resolve_sizes([(Axis.DP, FILL), (Axis.EP, 4), (Axis.TP, 4)], 6)
    with pytest.raises(LayoutError, match="tp_size must be a positive integer, got 0"):
        resolve_sizes([(Axis.DP, FILL), (Axis.TP, 0)], 8)
    with pytest.raises(LayoutError, match="at most one axis size can be inferred"):
        resolve_sizes([(Axis.DP, FILL), (Axis.TP, FILL)], 8)


@distributed(world_size=4)
def test_layout_groups_and_data_coordinates_follow_the_mesh(rank: int, world_size: int) -> None:
    layout = ParallelLayout.build([(Axis.PP, 2), (Axis.DP, FILL), (Axis.TP, 1)], data_axes=(Axis.DP,))
    pp, dp = divmod(rank, 2)  # (pp, dp) row-major
    assert layout.sizes == (2, 2, 1)
    assert layout.size(Axis.PP, Axis.DP) == 4
    assert layout.size(Axis.SP) == 1
    assert (layout.rank(Axis.PP), layout.rank(Axis.DP), layout.rank(Axis.DP, Axis.PP)) == (pp, dp, dp * 2 + pp)
    assert layout.ranks(Axis.DP) == [2 * pp, 2 * pp + 1]
    assert layout.ranks(Axis.PP) == [dp, dp + 2]
    assert layout.ranks(Axis.PP, Axis.DP) == [0, 1, 2, 3]
    assert layout.group_or_none(Axis.TP) is None
    assert layout.group_or_none(Axis.EP) is None
    assert layout.data_rank_and_size() == (dp, 2)
    assert dist.get_world_size(layout.group(Axis.DP, Axis.SP)) == 2  # absent axes are ignored
    with pytest.raises(LayoutError, match="none of"):
        layout.group(Axis.EP)
    assert layout.describe() == "pp=2 x dp=2 x tp=1"
