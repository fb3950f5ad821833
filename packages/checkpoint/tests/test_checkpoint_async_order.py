"""What asynchronous saves promise a caller beyond their files: a load waits for the pending writes (it reads the
newest save, never the older files still in place), `queue_after_saves` runs a job behind them only when they all
succeeded (a caller's commit of several saves as one unit), and `wait_for_writes` waits without raising."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from checkpoint_helpers import make_model
from cx_checkpoint import GeneralCheckpointIO


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_checkpoint_load_waits_for_pending_async_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer is held by a queued job that only a wait for the writes lets go: a load that did not wait would
    read the older checkpoint still at the path."""
    io = GeneralCheckpointIO()
    target = tmp_path / "model.safetensors"
    io.save_model(make_model(0), target, use_safetensors=True)
    waited = threading.Event()
    io.queue_after_saves(lambda: None if waited.wait(timeout=120) else pytest.fail("nobody waited for the writes"))
    io.save_model(make_model(1), target, use_safetensors=True, use_async=True)  # queued behind the held job
    real_drain = io._async.drain

    def drain() -> None:
        waited.set()
        real_drain()

    monkeypatch.setattr(io._async, "drain", drain)
    loaded = make_model(2)
    io.load_model(loaded, target)
    waited.set()  # (a failing load leaves the writer held otherwise)
    assert _equal(loaded, make_model(1)), "the load read the checkpoint the pending save was replacing"
    io.synchronize()


def test_checkpoint_queue_after_saves_runs_only_after_successful_saves(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    seen: list[bool] = []
    io.save_model(make_model(0), tmp_path / "a.safetensors", use_safetensors=True, use_async=True)
    io.queue_after_saves(lambda: seen.append((tmp_path / "a.safetensors").is_file()))
    io.synchronize()
    assert seen == [True], "the job ran after the save it follows had committed"

    (tmp_path / "blocker").write_text("a file where a directory is needed")
    io.save_model(make_model(0), tmp_path / "blocker" / "b.safetensors", use_safetensors=True, use_async=True)
    io.queue_after_saves(lambda: seen.append(True))
    with pytest.raises(OSError) as caught:
        io.synchronize()
    assert seen == [True], "a job queued behind a failed save must not run"
    assert any("skipped: an earlier asynchronous save failed" in note for note in caught.value.__notes__)
    io.synchronize()  # both reported once


def test_checkpoint_wait_for_writes_waits_and_leaves_errors_to_synchronize(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    (tmp_path / "blocker").write_text("a file where a directory is needed")
    io.save_model(make_model(0), tmp_path / "good.safetensors", use_safetensors=True, use_async=True)
    io.save_model(make_model(0), tmp_path / "blocker" / "m.safetensors", use_safetensors=True, use_async=True)
    io.wait_for_writes()  # raises nothing
    assert (tmp_path / "good.safetensors").is_file()
    with pytest.raises(OSError):
        io.synchronize()
    io.synchronize()  # reported once
