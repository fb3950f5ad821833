"""Checkpoints outlive changes to cx-train: a checkpoint written by an older cx-train (the fixture, written at
a4c5c7f when the trainer was still `cx_plugins.demo`; its README says how) resumes with today's, and its next steps
give the losses the original run logged without interruption.

The fixture holds the step-3 checkpoint of a 6-step run and that run's per-step losses. Resuming it runs steps 4-6
again from saved weights, moments, schedule position and data position; only the kernels' rounding can differ from
the original run, on another CPU (fp32, a 0.03M-parameter GPT, 3 steps: relative differences near 1e-6), so the
losses must agree to 1e-4 relative: a wrong data position, learning rate or moment would move them by 1e-2 or more.
The run is resumed as written (gemini, 2 ranks) and under another plugin, as a user may (low_level_zero, whose
different reduction order is rounding too).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cx_mesh.testing import distributed
from cx_train import parse_options
from cx_train._train import run
from cx_train.metrics._metrics_file import read_metrics

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_a4c5c7f"
RELATIVE = 1e-4


def _uninterrupted() -> dict[int, float]:
    lines = (FIXTURE / "uninterrupted.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


@distributed(world_size=2)
@pytest.mark.parametrize("plugin", ["gemini", "low_level_zero"])
def test_train_checkpoint_compat_resumes_with_the_uninterrupted_losses(
    rank: int, world_size: int, tmp_path: Path, plugin: str
) -> None:
    checkpoint = tmp_path / "checkpoint"  # a copy: resuming must not need to write into the user's checkpoint
    if rank == 0:
        shutil.copytree(FIXTURE / "checkpoint", checkpoint)
    torch.distributed.barrier()
    metrics = tmp_path / "metrics.jsonl"
    # the run's own resolved config.toml, as a user resumes it; the command line overrides its paths and plugin
    flags = ["--config", str(checkpoint / "config.toml"), "--resume", str(checkpoint), "--plugin", plugin]
    run(parse_options([*flags, "--save", str(tmp_path / "next"), "--metrics", str(metrics)], world_size=world_size))
    if rank == 0:
        resumed = {record["step"]: record["loss"] for record in read_metrics(metrics)}
        expected = _uninterrupted()
        assert sorted(resumed) == [4, 5, 6], resumed
        for step, loss in resumed.items():
            assert loss == pytest.approx(expected[step], rel=RELATIVE), (step, loss, expected[step])
        assert json.loads((tmp_path / "next" / "trainer.json").read_text())["step"] == 6
    torch.distributed.barrier()
