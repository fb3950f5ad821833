"""A save that fails on one rank (a bad path, a full disk) raises the same error on every rank, for every plugin's
checkpoint IO (model and optimizer, sharded and not, synchronous and asynchronous), never a hang or a collective
mismatch; training then goes on and the next save is right."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch.distributed as dist
from torch import nn

from cx_checkpoint import CheckpointSaveError, GeneralCheckpointIO
from cx_mesh import all_gather_bytes
from cx_mesh.testing import distributed
from cx_plugins import Booster, OptimizerWrapper
from plugins_test_helpers import assert_matches, boosted, data, reference, train


def _bad_path(rank: int, tmp_path: Path, name: str) -> Path:
    """Rank 0 (the saving rank) gets a path under a regular file; the others a good path."""
    blocker = tmp_path / "blocker"
    tmp_path.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        blocker.write_text("a file where a directory is needed")
    return (blocker if rank == 0 else tmp_path / f"good{rank}") / name


def _saves(booster: Booster, model: nn.Module, optimizer: OptimizerWrapper, path: Path, shard: bool) -> list[object]:
    return [
        lambda: booster.save_model(
            model, path / ("m" if shard else "m.safetensors"), shard=shard, use_safetensors=True
        ),
        lambda: booster.save_optimizer(optimizer, path / ("o" if shard else "o.safetensors"), shard=shard),
    ]


def _fail_everywhere(rank: int, save: object, match: str) -> None:
    with pytest.raises(CheckpointSaveError, match=rf"failed on rank\(s\) \[0\]: .*{match}") as caught:
        save()  # type: ignore[operator]
    messages = all_gather_bytes(str(caught.value).encode())  # tensor collectives: numpy is not a dependency
    assert len(set(messages)) == 1, f"the ranks raised different errors: {messages}"


@distributed(world_size=2)
@pytest.mark.parametrize("plugin", ["torch_ddp", "gemini", "zero2"])
def test_plugins_failed_save_raises_on_every_rank_and_training_goes_on(
    rank: int, world_size: int, tmp_path: Path, plugin: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    booster, _, model, optimizer = boosted(plugin)
    batches = data(3)
    train(rank, world_size, booster, model, optimizer, batches[:1])
    for shard in (False, True):
        for save in _saves(booster, model, optimizer, _bad_path(rank, tmp_path / str(shard), "ckpt"), shard):
            _fail_everywhere(rank, save, "Error")

    # a write error part-way through a sharded save (ENOSPC on the saving rank only)
    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    if rank == 0:
        monkeypatch.setattr(os, "fsync", no_space)
    for save in _saves(booster, model, optimizer, tmp_path / "full", shard=True):
        _fail_everywhere(rank, save, "No space left on device")
    monkeypatch.undo()
    assert not (tmp_path / "full" / "m").exists(), "a failed save commits nothing"

    # training goes on, in step on every rank, and the next save is exactly the trained state
    train(rank, world_size, booster, model, optimizer, batches[1:])
    booster.save_model(model, tmp_path / "after", shard=True, use_safetensors=True)
    booster.save_optimizer(optimizer, tmp_path / "after-optim", shard=True)
    expected = reference(batches)
    assert_matches(model, expected, f"{plugin} after failed saves")
    saved = reference(batches[:0], seed=7)
    GeneralCheckpointIO().load_model(saved, tmp_path / "after")
    assert_matches(saved, expected, f"{plugin}: checkpoint written after the failed saves")


@distributed(world_size=2)
def test_plugins_failed_async_save_surfaces_on_every_rank(rank: int, world_size: int, tmp_path: Path) -> None:
    booster, _, model, optimizer = boosted("torch_ddp")
    train(rank, world_size, booster, model, optimizer, data(1))
    bad = _bad_path(rank, tmp_path, "m.safetensors")
    booster.save_model(model, bad, use_safetensors=True, use_async=True)  # returns at once; fails in the background
    _fail_everywhere(rank, booster.synchronize, "Error")
    booster.synchronize()  # reported once

    # never awaited: the next save surfaces it, on every rank, before writing anything
    booster.save_model(model, bad, use_safetensors=True, use_async=True)
    if rank == 0:
        booster.checkpoint_io._async.drain()  # the failure has happened by now (test-only peek)
    dist.barrier()
    _fail_everywhere(
        rank, lambda: booster.save_model(model, tmp_path / "next.safetensors", use_safetensors=True), "Error"
    )
    assert not (tmp_path / "next.safetensors").exists()
    booster.save_model(model, tmp_path / "next.safetensors", use_safetensors=True)
    assert (tmp_path / "next.safetensors").is_file()
