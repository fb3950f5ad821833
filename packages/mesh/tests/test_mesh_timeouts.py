"""Collective timeouts: the mesh's groups honour the configured timeout, and a rank that is out of step makes every
rank of the group raise a `CollectiveTimeoutError` naming the group (not a hang, not a bare socket error)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cx_mesh import (
    CollectiveTimeoutError,
    ProcessGroupMesh,
    all_gather_flat,
    all_reduce,
    collective_timeout,
    describe_group,
    reduce_scatter_flat,
)
from cx_mesh.testing import distributed

_SHORT = timedelta(seconds=2)


@distributed(world_size=2, timeout=90, fresh=True)  # its own processes, initialised with 90 s
def test_mesh_groups_inherit_the_job_timeout(rank: int, world_size: int) -> None:
    # the harness initialises torch.distributed with its own timeout (90 s): groups created later use it
    assert collective_timeout() == timedelta(seconds=90)
    mesh = ProcessGroupMesh(world_size, axis_names=("dp",))
    assert mesh.timeout == timedelta(seconds=90)
    group = mesh.get_group_along_axis("dp")
    assert describe_group(group) == "group 'cx mesh (2,) along dp' (ranks [0, 1])"
    mesh.destroy_mesh_process_groups()
    with pytest.raises(ValueError, match="timeout must be positive"):
        ProcessGroupMesh(world_size, timeout=timedelta(0))


@pytest.mark.parametrize("async_op", [False, True])
@distributed(world_size=2, timeout=60, fresh=True)  # a timed-out gloo pair is not reused by later tests
def test_out_of_step_ranks_raise_a_named_timeout_on_every_rank(rank: int, world_size: int, async_op: bool) -> None:
    zero = ProcessGroupMesh(world_size, axis_names=("zero",), timeout=_SHORT).get_group_along_axis("zero")
    other = ProcessGroupMesh(world_size, axis_names=("other",), timeout=_SHORT).get_group_along_axis("other")

    # out of step: rank 0 reduces over the zero group while rank 1 gathers over another group of the same ranks
    def out_of_step() -> None:
        if rank == 0:
            work = reduce_scatter_flat(torch.empty(4), torch.ones(8), group=zero, async_op=async_op)
        else:
            work = all_gather_flat(torch.empty(8), torch.ones(4), group=other, async_op=async_op)
        if work is not None:
            work.wait()

    with pytest.raises(CollectiveTimeoutError) as raised:
        out_of_step()
    operation, axis = ("reduce-scatter", "zero") if rank == 0 else ("all-gather", "other")
    assert str(raised.value).startswith(
        f"{operation}" + (" (all-to-all)" if rank == 0 else "") + f" on group 'cx mesh (2,) along {axis}' "
        "(ranks [0, 1]) timed out after 0:00:02"
    )


@distributed(world_size=2, timeout=60, fresh=True)
def test_all_reduce_timeout_names_the_group(rank: int, world_size: int) -> None:
    group = ProcessGroupMesh(world_size, axis_names=("dp",), timeout=_SHORT).get_group_along_axis("dp")
    total = torch.tensor([float(rank)])
    all_reduce(total, group=group)  # in step: works
    assert total.item() == 1.0
    if rank == 0:  # rank 1 skips the collective: rank 0 must not wait for ever
        with pytest.raises(CollectiveTimeoutError, match=r"all-reduce on group 'cx mesh \(2,\) along dp'"):
            all_reduce(torch.ones(1), group=group)
    dist.barrier()
