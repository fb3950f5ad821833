"""A failed peer is not waited for: a rank that raised stops the ranks waiting for it with a `PeerFailedError` naming
it and its error, well before the group's timeout (60 s here: had the ranks waited for it, the error would be a
`CollectiveTimeoutError`, or the harness would have killed the waiting rank without its report)."""

from __future__ import annotations

import sys
import time

import pytest
import torch
import torch.distributed as dist

from cx_mesh import (
    PeerFailedError,
    ProcessGroupMesh,
    all_reduce,
    all_to_all_single,
    launch,
    named_collective,
    report_failure,
)
from cx_mesh.testing import DistributedTestFailure, distributed, spawn

_FAILED = r"cannot complete: rank 1 raised RuntimeError: boom on rank 1"


@pytest.mark.parametrize("operation", ["all-to-all", "all-reduce"])
@distributed(world_size=2, timeout=60, fresh=True)  # the failure record stays in the store: fresh processes
def test_a_failure_recorded_by_a_live_peer_stops_a_collective(rank: int, world_size: int, operation: str) -> None:
    group = ProcessGroupMesh(world_size, axis_names=("ep",)).get_group_along_axis("ep")

    def collective() -> None:
        if operation == "all-to-all":
            all_to_all_single(torch.empty(2), torch.ones(2), group=group)
        else:
            all_reduce(torch.ones(2), group=group)

    if rank == 1:
        try:
            raise RuntimeError("boom on rank 1")
        except RuntimeError as error:
            report_failure(error)  # what launch's excepthook (and the test harness) do first; the process lives on
        dist.barrier()
        collective()  # completes rank 0's abandoned collective, so both ranks end cleanly
        return
    with pytest.raises(PeerFailedError, match=f"{operation} on group 'cx mesh \\(2,\\) along ep' .*{_FAILED}"):
        collective()  # polls the store between one-second slices of the wait
    dist.barrier()


def _raise_through_launch_on_rank_1(rank: int, world_size: int, port: int) -> None:
    launch(rank, world_size, "127.0.0.1", port, verbose=False)  # installs the failure hook
    pp = ProcessGroupMesh(world_size, axis_names=("pp",)).get_group_along_axis("pp")
    if rank == 1:
        try:
            raise RuntimeError("boom on rank 1")
        except RuntimeError:
            sys.excepthook(*sys.exc_info())  # as for an uncaught exception: exits
    work = dist.irecv(torch.empty(4), 1, group=pp)
    assert work is not None
    with named_collective("receive from rank 1", pp):
        work.wait()  # the closed connection ends it at once; the error names the recorded failure


def test_an_uncaught_exception_under_launch_stops_the_peers_with_its_error() -> None:
    with pytest.raises(DistributedTestFailure) as failure:
        spawn(_raise_through_launch_on_rank_1, 2, timeout=60)
    report = str(failure.value)
    assert "rank 1 exited with code 1 before reporting a result" in report
    assert f"PeerFailedError: receive from rank 1 on group 'cx mesh (2,) along pp' (ranks [0, 1]) {_FAILED}" in report


@pytest.mark.parametrize("operation", ["all-to-all", "all-reduce"])
@distributed(world_size=2, timeout=60)
def test_a_slow_live_peer_is_waited_for_across_poll_slices(rank: int, world_size: int, operation: str) -> None:
    """A peer that arrives after several of the one-second poll slices (but well within the group's timeout) is
    waited for, and the collective's result is right: an expired slice must leave the collective in flight."""
    group = ProcessGroupMesh(world_size, axis_names=("ep",)).get_group_along_axis("ep")
    if rank == 1:
        time.sleep(2.5)  # two and a half of wait_named's one-second poll slices
    if operation == "all-to-all":
        received = torch.empty(2)
        all_to_all_single(received, torch.tensor([10.0 * rank, 10.0 * rank + 1]), group=group)
        assert received.tolist() == [float(rank), 10.0 + rank]
    else:
        total = torch.tensor([float(rank + 1)])
        all_reduce(total, group=group)
        assert total.item() == 3.0
