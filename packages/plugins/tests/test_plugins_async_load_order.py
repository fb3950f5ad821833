"""Under a plugin whose master rank writes alone (TorchDDPPlugin here), a load made while an asynchronous save is
pending waits for it on every rank: rank 1 reads the new files, not the ones the master is replacing. A failed
asynchronous save is raised by the next load on every rank, instead of loading."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cx_checkpoint import CheckpointSaveError
from cx_mesh import all_gather_bytes
from cx_mesh.testing import distributed
from plugins_test_helpers import boosted, data, full_state, train


@distributed(world_size=2)
def test_plugins_load_waits_for_the_masters_pending_save_on_every_rank(
    rank: int, world_size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The master's writer is held by a queued job that only its wait for the writes lets go: a rank that loaded
    without waiting for the master would read the older checkpoint still at the path."""
    booster, _, model, optimizer = boosted("torch_ddp")
    target = tmp_path / "model.safetensors"
    booster.save_model(model, target, use_safetensors=True)
    train(rank, world_size, booster, model, optimizer, data(1))
    trained = {name: value.clone() for name, value in full_state(model).items()}
    io = booster.checkpoint_io
    waited = threading.Event()
    if rank == 0:
        io.queue_after_saves(lambda: None if waited.wait(timeout=120) else pytest.fail("nobody waited"))
        real_drain = io._async.drain

        def drain() -> None:
            waited.set()
            real_drain()

        monkeypatch.setattr(io._async, "drain", drain)
    booster.save_model(model, target, use_safetensors=True, use_async=True)  # queued behind the held job
    booster.load_model(model, target)  # the older file holds the untrained weights
    waited.set()  # (a failing load leaves the writer held otherwise)
    for name, value in full_state(model).items():
        assert torch.equal(value, trained[name]), f"rank {rank} read the checkpoint the pending save was replacing"
    booster.synchronize()


@distributed(world_size=2)
def test_plugins_failed_async_save_is_raised_by_the_next_load(rank: int, world_size: int, tmp_path: Path) -> None:
    booster, _, model, _ = boosted("torch_ddp")
    good = tmp_path / "good.safetensors"
    booster.save_model(model, good, use_safetensors=True)
    if rank == 0:
        (tmp_path / "blocker").write_text("a file where a directory is needed")
    dist.barrier()
    booster.save_model(model, tmp_path / "blocker" / "m.safetensors", use_safetensors=True, use_async=True)
    with pytest.raises(CheckpointSaveError, match=r"failed on rank\(s\) \[0\].*an earlier asynchronous save") as got:
        booster.load_model(model, good)
    messages = all_gather_bytes(str(got.value).encode())
    assert len(set(messages)) == 1, f"the ranks raised different errors: {messages}"
    booster.load_model(model, good)  # reported once
    booster.synchronize()
