"""Bad input to the mesh gives a clear error on every rank, never a hang."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from cx_mesh import DistCoordinator, ProcessGroupMesh, assert_same_across_ranks
from cx_mesh.testing import distributed


def test_mesh_errors_before_launch() -> None:
    assert not dist.is_initialized()
    for build in (lambda: ProcessGroupMesh(2), DistCoordinator, lambda: assert_same_across_ranks(1)):
        with pytest.raises(RuntimeError, match="initialised first"):
            build()


@distributed(world_size=4)
def test_mesh_errors_product_differs_from_world(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match=r"multiply to 8, but the world has 4 ranks"):
        ProcessGroupMesh(2, 2, 2)
    with pytest.raises(ValueError, match="positive integers"):
        ProcessGroupMesh(4, 0)
    with pytest.raises(ValueError, match="at least one axis"):
        ProcessGroupMesh()


@distributed(world_size=4)
def test_mesh_errors_bad_axes(rank: int, world_size: int) -> None:
    mesh = ProcessGroupMesh(2, 2, axis_names=("dp", "tp"))
    with pytest.raises(IndexError, match="axis 2 is out of range"):
        mesh.get_group_along_axis(2)
    with pytest.raises(IndexError, match="out of range"):
        mesh.size(-3)
    with pytest.raises(ValueError, match="unknown axis name 'pp'"):
        mesh.coordinate("pp")
    with pytest.raises(ValueError, match="repeat an axis"):
        mesh.get_group_along_axis([0, "dp"])
    with pytest.raises(ValueError, match=r"indices \(5,\) along axis 0"):
        mesh.get_group_along_axis(0, indices_at_axis=[5])
    with pytest.raises(ValueError, match="2 names for 3 axes"):
        ProcessGroupMesh(1, 2, 2, axis_names=("a", "b"))
