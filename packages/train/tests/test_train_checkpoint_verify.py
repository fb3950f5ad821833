"""`cx-checkpoint-verify` on a cx-train checkpoint covers all of it: model and optimizer (with `optimizer.json`), and
`trainer.json` through the `cx-checksums.json` manifest the demo records with `cx_checkpoint.record_checksums`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from cx_checkpoint import CHECKSUMS_FILE, VerifyOutcome, verify_checkpoints
from cx_mesh.testing import distributed
from cx_train.checkpoint._checkpointing import TrainerState, save_checkpoint
from cx_train.checkpoint._verification import verification_problem
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


def test_train_checkpoint_verify_hint_only_where_no_verify_loads(tmp_path: Path) -> None:
    """`--resume` names a damaged checkpoint up front; the "--no-verify loads it anyway" hint is given only where
    that is true (damaged bytes under an intact structure), not for an index the load refuses too (it was given for
    both)."""
    fixture = Path(__file__).resolve().parent / "fixtures" / "checkpoint_a4c5c7f" / "checkpoint"
    flipped, escaping = tmp_path / "flipped", tmp_path / "escaping"
    shutil.copytree(fixture, flipped)
    shutil.copytree(fixture, escaping)
    shard = next((flipped / "model").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor's bytes
    shard.write_bytes(bytes(data))
    problem = verification_problem(flipped)
    assert problem is not None
    assert "ChecksumMismatchError" in problem
    assert "--no-verify loads it anyway" in problem
    index = escaping / "model" / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    first = next(iter(content["weight_map"]))
    content["weight_map"][first] = "../elsewhere.safetensors"
    index.write_text(json.dumps(content))
    problem = verification_problem(escaping)
    assert problem is not None
    assert "not a plain file name in the checkpoint directory" in problem
    assert "--no-verify" not in problem
    assert "loading refuses it too" in problem
