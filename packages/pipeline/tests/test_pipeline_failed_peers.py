"""Pipeline transfers are named waits: a stage that fails stops its neighbour at once with a `PeerFailedError` naming
the failed stage's rank and its error, and a stage that is alive but stuck gives a `CollectiveTimeoutError` naming
the peer's stage and rank, the group and the timeout (before: a bare gloo "Timed out waiting 600000ms for recv")."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cx_mesh import CollectiveTimeoutError, ProcessGroupMesh
from cx_mesh.testing import DistributedTestFailure, distributed, run_distributed
from cx_pipeline import OneForwardOneBackwardSchedule, PipelineStageManager, split_model
from pipeline_helpers import ToyNet, batches, toy_batch, toy_criterion

_RECEIVE = r"pipeline receive from stage 1 \(rank 1\) on group 'cx mesh \(2,\) along pp' \(ranks \[0, 1\]\)"


class _Stuck(Exception):
    pass


def _schedule(timeout: timedelta | None) -> tuple[OneForwardOneBackwardSchedule, torch.nn.Module]:
    manager = PipelineStageManager(ProcessGroupMesh(2, axis_names=("pp",), timeout=timeout), "pp")
    schedule = OneForwardOneBackwardSchedule(manager, num_microbatches=2)
    return schedule, split_model(ToyNet(2), manager)


def _last_stage_raises(rank: int, world_size: int) -> None:
    schedule, model = _schedule(None)  # the job's timeout (60 s): rank 0 must not wait for it

    def criterion(outputs: Any, micro_batch: Any) -> torch.Tensor:
        raise ValueError("boom on stage 1")  # only the last stage (rank 1) computes the loss: it never sends back

    batch = toy_batch(4, False, True, seed=0)
    schedule.forward_backward_step(model, batches(batch), toy_criterion)  # the first step probes (checked apart)
    schedule.forward_backward_step(model, batches(batch), criterion)


def test_a_failed_stage_stops_its_neighbour_with_its_error() -> None:
    # Rank 1 raises (the harness records its error in the store, as cx_mesh.launch's excepthook does, and its
    # process ends); rank 0, waiting for its gradient, must report a PeerFailedError naming rank 1 within the
    # harness's grace of a few seconds after rank 1's failure, else it is killed without a report.
    with pytest.raises(DistributedTestFailure) as failure:
        run_distributed(_last_stage_raises, 2, fresh=True, timeout=60)
    report = str(failure.value)
    assert "--- rank 1 raised" in report
    assert "ValueError: boom on stage 1" in report
    assert re.search(f"PeerFailedError: {_RECEIVE} cannot complete: rank 1 raised ValueError: boom on stage 1", report)


@distributed(world_size=2, timeout=60, fresh=True)  # a timed-out gloo pair is not reused
def test_a_stuck_stage_gives_a_named_timeout(rank: int, world_size: int) -> None:
    schedule, model = _schedule(timedelta(seconds=2))

    def criterion(outputs: Any, micro_batch: Any) -> torch.Tensor:
        dist.barrier()  # alive but stuck (the default group, 60 s) until stage 0 has given up waiting
        raise _Stuck

    batch = toy_batch(4, False, True, seed=0)
    schedule.forward_backward_step(model, batches(batch), toy_criterion)  # in step (and the probe is done)
    if rank == 1:
        with pytest.raises(_Stuck):
            schedule.forward_backward_step(model, batches(batch), criterion)
        return
    with pytest.raises(CollectiveTimeoutError, match=f"{_RECEIVE} timed out after 0:00:02"):
        schedule.forward_backward_step(model, batches(batch), toy_criterion)
    dist.barrier()
