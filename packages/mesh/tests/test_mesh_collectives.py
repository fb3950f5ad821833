"""The flat collectives every package uses: all_gather_flat and reduce_scatter_flat (whose SUM over gloo goes
through an all-to-all and a local sum) against a sum computed here, synchronous and asynchronous."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cx_mesh import ProcessGroupMesh, all_gather_flat, reduce_scatter_flat, reduce_scatter_scratch_numel
from cx_mesh.testing import PerTestCache, distributed


def _rank_tensor(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(dtype)


@distributed(world_size=(1, 2, 4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("async_op", [False, True])
def test_mesh_reduce_scatter_flat_sums_each_slice(
    rank: int, world_size: int, dtype: torch.dtype, async_op: bool
) -> None:
    numel = 6 * world_size
    output = torch.empty(6, dtype=dtype)
    work = reduce_scatter_flat(output, _rank_tensor(rank, numel, dtype), group=None, async_op=async_op)
    assert (work is not None) == async_op
    if work is not None:
        work.wait()
        assert work.wait()  # waiting twice is harmless
    total = torch.stack([_rank_tensor(r, numel, torch.float64) for r in range(world_size)]).sum(0)
    expected = total.view(world_size, 6)[rank]
    tolerance = {torch.bfloat16: 3e-2, torch.float32: 1e-6, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(output.double(), expected.to(dtype).double(), rtol=tolerance, atol=tolerance)
    expected_scratch = numel if world_size > 1 else 0  # gloo exchanges whole slices: one input-sized buffer
    assert reduce_scatter_scratch_numel(numel) == expected_scratch


_MESHES: PerTestCache[int, ProcessGroupMesh] = PerTestCache()


@distributed(world_size=4)
def test_mesh_reduce_scatter_flat_over_a_subgroup_and_other_ops(rank: int, world_size: int) -> None:
    if world_size not in _MESHES:  # groups stay alive in the worker pool: make them once
        _MESHES[world_size] = ProcessGroupMesh(2, 2, axis_names=("dp", "tp"))
    mesh = _MESHES[world_size]
    group = mesh.get_group_along_axis("dp")
    members = dist.get_process_group_ranks(group)
    output = torch.empty(3)
    reduce_scatter_flat(output, _rank_tensor(rank, 6, torch.float32), group=group)
    total = torch.stack([_rank_tensor(r, 6, torch.float32) for r in members]).sum(0)
    torch.testing.assert_close(output, total.view(2, 3)[dist.get_rank(group)])
    # MAX is not a sum: the backend's own reduce-scatter
    reduce_scatter_flat(output, _rank_tensor(rank, 6, torch.float32), dist.ReduceOp.MAX, group=group)
    highest = torch.stack([_rank_tensor(r, 6, torch.float32) for r in members]).amax(0)
    torch.testing.assert_close(output, highest.view(2, 3)[dist.get_rank(group)])


@distributed(world_size=(2, 4))
def test_mesh_all_gather_flat_is_rank_major(rank: int, world_size: int) -> None:
    output = torch.empty(3 * world_size)
    all_gather_flat(output, torch.full((3,), float(rank)))
    torch.testing.assert_close(output, torch.arange(world_size).repeat_interleave(3).float())
