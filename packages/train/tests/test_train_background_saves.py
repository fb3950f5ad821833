"""cx-train `--save-every` saves in the background (here under `--plugin hybrid --tp 2`, whose gathers are collective):
the run trains on while a checkpoint's writes are held back, and that checkpoint still resumes to the uninterrupted
run's losses bit for bit; a run that fails while a write is pending waits for it before it gives up the `--save`
folder, so the checkpoint it committed is whole."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from cx_mesh.testing import distributed
from cx_train import _train, parse_options
from cx_train.checkpoint import _run_saves
from cx_train.checkpoint._checkpointing import save_checkpoint
from cx_train.step._grad_norm import clip_bound

pytest.importorskip("transformers")

FLAGS = ["--model", "llama", "--plugin", "hybrid", "--tp", "2", "--hidden-size", "32", "--num-layers", "1"]
FLAGS += ["--seq-len", "16", "--batch-size", "2", "--log-every", "4", "--lr", "0.01"]


def _hold_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every fsync off the training thread (the checkpoint writer's, before it commits anything) waits until the
    returned event is set."""
    opened = threading.Event()
    real_fsync = os.fsync

    def held(fd: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            assert opened.wait(timeout=300), "the test never let the writes go"
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", held)
    return opened


@distributed(world_size=2, timeout=600)
def test_train_save_every_trains_on_while_writing_and_resumes_exactly(
    rank: int, world_size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 3 and 4 train while the step-2 checkpoint's writes are held back (its folder not committed yet when
    they end); released, it holds step 2's state: resumed from a copy of it, steps 3 and 4 repeat the run's losses."""
    saved, at_step_2 = tmp_path / "run", tmp_path / "step2"
    opened = _hold_writes(monkeypatch)
    real_save = save_checkpoint  # what the run's saves call, replaced there below
    committed_before_release: list[bool] = []

    def save(*args: Any, **kwargs: Any) -> None:
        if args[4].step == 4:  # the final save: the step-2 checkpoint is still held back
            committed_before_release.append((saved / "trainer.json").exists())
            opened.set()
            args[0].synchronize()
            if rank == 0:
                shutil.copytree(saved, at_step_2)
            dist.barrier()
        real_save(*args, **kwargs)

    monkeypatch.setattr(_run_saves, "save_checkpoint", save)
    whole = _train.run(parse_options([*FLAGS, "--steps", "4", "--save", str(saved), "--save-every", "2"]))
    monkeypatch.undo()
    assert committed_before_release == [False], "the step-2 checkpoint was not written in the background"
    assert json.loads((at_step_2 / "trainer.json").read_text())["step"] == 2
    resumed = _train.run(parse_options([*FLAGS, "--steps", "4", "--resume", str(at_step_2), "--no-verify"]))
    assert resumed == whole[2:]


@distributed(world_size=2, timeout=600)
def test_train_failed_run_waits_for_its_pending_save(
    rank: int, world_size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 3 fails on every rank while the step-2 checkpoint is still held back. The held writes go only when a
    rank waits for its writes: the run raises only after the step-2 checkpoint is committed."""
    saved = tmp_path / "run"
    opened = _hold_writes(monkeypatch)
    real_wait: Callable[[_run_saves.RunSaves], None] = _run_saves.RunSaves.wait_for_writes

    def wait_for_writes(self: _run_saves.RunSaves) -> None:
        opened.set()
        real_wait(self)

    monkeypatch.setattr(_run_saves.RunSaves, "wait_for_writes", wait_for_writes)
    steps: list[int] = []

    def failing_at_step_3(clip: float, logging: bool) -> float:
        steps.append(len(steps) + 1)
        if len(steps) == 3:
            raise RuntimeError("step 3 failed")
        return clip_bound(clip, logging)

    monkeypatch.setattr(_train, "clip_bound", failing_at_step_3)
    with pytest.raises(RuntimeError, match="step 3 failed"):
        _train.run(parse_options([*FLAGS, "--steps", "6", "--save", str(saved), "--save-every", "2"]))
    committed = (saved / "trainer.json").exists()  # rank 0 commits, behind its writes
    opened.set()  # (a run that did not wait leaves the writer held otherwise)
    if rank == 0:
        assert committed, "the run ended (and gave up --save) before its pending checkpoint was written"
        assert json.loads((saved / "trainer.json").read_text())["step"] == 2
    dist.barrier()
