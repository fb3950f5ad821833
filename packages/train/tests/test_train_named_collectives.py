"""cx-train's own collectives are cx-mesh's named ones: a peer killed between steps used to surface from the progress
line's all-reduce as a bare gloo "Connection reset by peer" (under Gemini, whose own collectives were already named);
now the surviving rank's error says what was being reduced, on which group, and which rank ended."""

from __future__ import annotations

import os

import pytest
import torch

from cx_mesh import PeerFailedError
from cx_mesh.testing import DistributedTestFailure, spawn
from cx_train.metrics._progress import Progress, StepOutput


def _progress_with_rank_1_killed(rank: int, world_size: int) -> None:
    progress = Progress(10, torch.device("cpu"))
    step = StepOutput(torch.tensor(2.0 + rank), None, None)
    assert not progress.record(step, tokens=8)  # both ranks: the mean loss of the step
    assert progress.losses == [2.5]
    if rank == 1:
        os._exit(1)  # killed between steps, no error recorded (as under SIGKILL)
    with pytest.raises(PeerFailedError) as raised:
        progress.record(step, tokens=8)
    assert str(raised.value).startswith(
        "progress-line all-reduce (the step's loss, aux loss, stop flag, expert counts) on the default group (all "
        "ranks) failed on rank 0: rank 1, the other rank of this group, ended (its connection closed)"
    ), str(raised.value)


def test_train_progress_line_names_a_killed_peer() -> None:
    with pytest.raises(DistributedTestFailure) as failure:
        spawn(_progress_with_rank_1_killed, 2, timeout=60)
    report = str(failure.value)
    assert "rank 1 exited with code 1 before reporting a result" in report
    assert "rank 0 raised" not in report, report  # rank 0 got the named error it expected
