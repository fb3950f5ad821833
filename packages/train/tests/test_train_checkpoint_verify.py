"""`cx-checkpoint-verify` on a cx-train checkpoint covers all of it: model and optimizer (with `optimizer.json`), and
`trainer.json` through the `cx-checksums.json` manifest the demo records with `cx_checkpoint.record_checksums`."""

from __future__ import annotations

from pathlib import Path

import torch

from cx_checkpoint import CHECKSUMS_FILE, VerifyOutcome, verify_checkpoints
from cx_mesh.testing import distributed
from cx_train.checkpoint._checkpointing import TrainerState, save_checkpoint
from train_test_helpers import boosted, data, train


@distributed(world_size=2)
def test_train_checkpoint_trainer_json_is_verified(rank: int, world_size: int, tmp_path: Path) -> None:
    booster, _, model, optimizer = boosted("torch_ddp")
    train(rank, world_size, booster, model, optimizer, data(1))
    directory = tmp_path / "ckpt"
    save_checkpoint(booster, model, optimizer, directory, TrainerState(step=1, plugin="torch_ddp", world_size=2))
    torch.distributed.barrier()
    if rank == 0:
        results = {r.path.relative_to(directory).as_posix(): r for r in verify_checkpoints(directory)}
        assert set(results) == {
            "model/model.safetensors.index.json",
            "optimizer/optimizer.safetensors.index.json",
            CHECKSUMS_FILE,
        }, results
        assert all(r.outcome is VerifyOutcome.OK for r in results.values()), results
        state = directory / "trainer.json"
        state.write_text(state.read_text().replace('"step": 1', '"step": 7'))  # corrupt, still valid JSON
        failed = [r for r in verify_checkpoints(directory) if r.outcome is VerifyOutcome.FAILED]
        assert [r.path.name for r in failed] == [CHECKSUMS_FILE], failed
        assert "trainer.json" in failed[0].detail, failed[0].detail
    torch.distributed.barrier()
