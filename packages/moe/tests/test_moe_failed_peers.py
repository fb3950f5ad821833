"""The expert-parallel all-to-all is a named collective: a stuck ep peer gives a `CollectiveTimeoutError` naming the
group and the timeout, a failed one a `PeerFailedError` naming that rank and its error (not the group's timeout)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cx_mesh import CollectiveTimeoutError, PeerFailedError, ProcessGroupMesh, all_to_all_single, report_failure
from cx_mesh.testing import distributed
from cx_moe import ExpertOptions, MoeLayer, RouterOptions
from moe_test_helpers import HIDDEN, INTER, rank_batch

_GROUP = r"all-to-all on group 'cx mesh \(1, 2\) along ep' \(ranks \[0, 1\]\)"


def _layer(timeout: timedelta | None) -> tuple[MoeLayer, dist.ProcessGroup]:
    """A dropless layer of 4 experts at ep 2, and its ep group."""
    mesh = ProcessGroupMesh(1, 2, axis_names=("moe_dp", "ep"), timeout=timeout)
    ep_group = mesh.get_group_along_axis("ep")
    torch.manual_seed(0)
    layer = MoeLayer(
        ExpertOptions(HIDDEN, INTER),
        RouterOptions(num_experts=4, top_k=2),
        ep_group=ep_group,
        moe_dp_group=mesh.get_group_along_axis("moe_dp"),
    )
    return layer, ep_group


@distributed(world_size=2, timeout=60, fresh=True)  # a failure record stays in the job's store: fresh processes
def test_a_failed_ep_peer_stops_the_all_to_all(rank: int, world_size: int) -> None:
    layer, ep_group = _layer(None)  # the job's timeout, 60 s: the error must come long before it
    x, _ = rank_batch(rank, 6)
    if rank == 1:
        try:
            raise RuntimeError("boom on rank 1")  # before its all-to-all
        except RuntimeError as error:
            report_failure(error)  # what cx_mesh.launch's excepthook does first; this process stays alive
        dist.barrier()
        counts = torch.zeros(4, dtype=torch.int64)  # its 2 x 2 expert counts per rank
        all_to_all_single(torch.empty_like(counts), counts, group=ep_group)  # completes rank 0's abandoned exchange
        return
    with pytest.raises(PeerFailedError, match=f"{_GROUP} cannot complete: rank 1 raised RuntimeError: boom on rank 1"):
        layer(x)
    dist.barrier()


@distributed(world_size=2, timeout=60, fresh=True)  # a timed-out gloo group is not reused
def test_a_stuck_ep_peer_gives_a_named_timeout(rank: int, world_size: int) -> None:
    layer, _ = _layer(timedelta(seconds=2))
    x, _ = rank_batch(rank, 6)
    layer(x)  # in step: works
    if rank == 0:  # rank 1 is alive but skips the layer: rank 0 waits the group's whole timeout, then says so
        with pytest.raises(CollectiveTimeoutError, match=f"{_GROUP} timed out after 0:00:02"):
            layer(x)
    dist.barrier()
