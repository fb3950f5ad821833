"""ProcessGroupMesh geometry and groups on real multi-rank worlds, checked against tables computed by hand."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist

from cx_mesh import ProcessGroupMesh
from cx_mesh.testing import distributed


def _expected_coordinate(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """C order, written independently of the implementation: the last axis varies fastest."""
    return next(c for i, c in enumerate(itertools.product(*(range(s) for s in shape))) if i == rank)


def _group_sum(group: dist.ProcessGroup, value: int) -> int:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor, group=group)
    return int(tensor.item())


@pytest.mark.parametrize("shape", [(4,), (2, 2), (2, 1, 2)])
@distributed(world_size=4)
def test_mesh_grid_coordinates_and_axis_groups(rank: int, world_size: int, shape: tuple[int, ...]) -> None:
    mesh = ProcessGroupMesh(*shape)
    assert mesh.shape == shape
    assert mesh.rank == rank
    assert mesh.coordinate() == _expected_coordinate(rank, shape)
    for axis, size in enumerate(shape):
        assert mesh.size(axis) == size
        group = mesh.get_group_along_axis(axis)
        expected = sorted(
            r
            for r in range(world_size)
            if all(_expected_coordinate(r, shape)[a] == mesh.coordinate(a) for a in range(len(shape)) if a != axis)
        )
        assert mesh.get_ranks_in_group(group) == expected
        assert dist.get_process_group_ranks(group) == expected
        # the group really communicates among exactly those ranks
        assert _group_sum(group, rank) == sum(expected)
        assert mesh.get_group_along_axis(axis) is group  # cached
    mesh.destroy_mesh_process_groups()


@distributed(world_size=8, timeout=180)
def test_mesh_grid_three_axes_multi_axis_and_partial_groups(rank: int, world_size: int) -> None:
    shape = (2, 2, 2)
    mesh = ProcessGroupMesh(*shape, axis_names=("dp", "pp", "tp"))
    assert mesh.coordinate() == _expected_coordinate(rank, shape)
    assert mesh.coordinate("tp") == rank % 2
    assert mesh.size("pp") == 2
    # two axes at once: ranks sharing the pp coordinate
    dp_tp = mesh.get_group_along_axis(["dp", "tp"])
    expected = sorted(r for r in range(8) if _expected_coordinate(r, shape)[1] == mesh.coordinate(1))
    assert mesh.get_ranks_in_group(dp_tp) == expected
    assert _group_sum(dp_tp, 1) == 4
    # a partial group along pp: only pp index 0 takes part, so only the 4 ranks with pp == 0 are members
    partial = mesh.create_group_along_axis("pp", indices_at_axis=[0])
    if mesh.coordinate("pp") == 0:
        assert partial is not None
        assert mesh.get_ranks_in_group(partial) == [rank]
        assert mesh.get_group_along_axis("pp", indices_at_axis=[0]) is partial  # cached, no new collective
    else:
        assert partial is None
        with pytest.raises(ValueError, match="not in any group along axis 'pp'"):
            mesh.get_group_along_axis("pp", indices_at_axis=[0])
    # partial multi-axis: dp indices [1] x tp indices [0, 1]
    both = mesh.create_group_along_axis(["dp", "tp"], indices_at_axis=[[1], [0, 1]])
    members = sorted(
        r
        for r in range(8)
        if _expected_coordinate(r, shape)[0] == 1 and _expected_coordinate(r, shape)[1] == mesh.coordinate(1)
    )
    assert (both is not None) == (rank in members)
    if both is not None:
        assert mesh.get_ranks_in_group(both) == members
        assert _group_sum(both, 1) == 2
    mesh.destroy_mesh_process_groups()


@distributed(world_size=4)
def test_mesh_grid_device_mesh_interop(rank: int, world_size: int) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = ProcessGroupMesh(2, 2, axis_names=("dp", "tp"))
    device_mesh = mesh.to_device_mesh("cpu")
    assert device_mesh.mesh.tolist() == [[0, 1], [2, 3]]
    assert device_mesh.mesh_dim_names == ("dp", "tp")
    assert device_mesh.get_local_rank("tp") == mesh.coordinate("tp")
    torch.manual_seed(0)
    full = torch.randn(4, 6)
    dtensor = distribute_tensor(full, device_mesh, [Replicate(), Shard(1)])
    assert dtensor.to_local().shape == (4, 3)
    assert torch.equal(dtensor.full_tensor(), full)
    mesh.destroy_mesh_process_groups()


@distributed(world_size=2)
def test_mesh_grid_world_size_product(rank: int, world_size: int) -> None:
    mesh = ProcessGroupMesh(world_size)
    assert mesh.size() == math.prod(mesh.shape) == world_size
