"""cx-train checkpoints are atomic as a whole: model, optimizer and trainer.json are committed together, so an
interruption between the parts leaves the previous checkpoint whole (and `--resume` resumes it consistently)."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from cx_checkpoint import CheckpointSaveError, GeneralCheckpointIO
from cx_mesh.testing import distributed
from cx_plugins import Booster
from cx_plugins.models import GPT
from cx_train import parse_options
from cx_train._train import run
from cx_train.checkpoint._checkpointing import TrainerState, load_checkpoint, save_checkpoint
from cx_train.checkpoint._save_lock import hold_save_folder
from train_test_helpers import CONFIG, boosted, data, train


class _Killed(BaseException):
    """Stands for the process dying: nothing after it runs (no cleanup on the way out either)."""


@distributed(world_size=2)
@pytest.mark.parametrize("interrupt_at", ["after_model", "after_optimizer"])
def test_train_checkpoint_interrupted_between_parts_keeps_previous(
    rank: int, world_size: int, tmp_path: Path, interrupt_at: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    booster, plain, model, optimizer = boosted("torch_ddp")
    batches = data(2)
    directory = tmp_path / "ckpt"
    train(rank, world_size, booster, model, optimizer, batches[:1])
    save_checkpoint(booster, model, optimizer, directory, TrainerState(step=1, plugin="torch_ddp", world_size=2))
    at_step_1 = {name: value.clone() for name, value in plain.state_dict().items()}
    moments_1 = optimizer.unwrap().state_dict()["state"][0]["exp_avg"].clone()

    train(rank, world_size, booster, model, optimizer, batches[1:])
    real_save_optimizer = Booster.save_optimizer

    def interrupted_optimizer_save(self: Booster, *args: object, **kwargs: object) -> None:
        if interrupt_at == "after_model":
            raise _Killed()
        real_save_optimizer(self, *args, **kwargs)  # type: ignore[arg-type]

    real_synchronize = Booster.synchronize
    waits: list[Booster] = []

    def interrupted_synchronize(self: Booster) -> None:
        waits.append(self)
        if len(waits) > 1:  # the first waits for the previous save; the second ends the writes, just before the commit
            raise _Killed()
        real_synchronize(self)

    monkeypatch.setattr(Booster, "save_optimizer", interrupted_optimizer_save)
    monkeypatch.setattr(Booster, "synchronize", interrupted_synchronize)  # just before trainer.json
    with pytest.raises(_Killed):
        save_checkpoint(booster, model, optimizer, directory, TrainerState(step=2, plugin="torch_ddp", world_size=2))
    monkeypatch.undo()
    torch.distributed.barrier()

    # what --resume would load: step 1, with the model and the optimizer of step 1
    assert json.loads((directory / "trainer.json").read_text())["step"] == 1
    resumed_booster, resumed_plain, resumed_model, resumed_optimizer = boosted("torch_ddp", seed=5)
    state = load_checkpoint(resumed_booster, resumed_model, resumed_optimizer, directory)
    assert state.step == 1
    for name, value in resumed_plain.state_dict().items():
        assert torch.equal(value, at_step_1[name]), f"{name}: the model is not the one of step {state.step}"
    assert torch.equal(resumed_optimizer.unwrap().state_dict()["state"][0]["exp_avg"], moments_1)
    assert torch.equal(resumed_optimizer.unwrap().state_dict()["state"][0]["step"], torch.tensor(1.0)), (
        "the optimizer is not the one of step 1"
    )

    # the next save completes and replaces the checkpoint as a whole (the leftover staging is cleaned up)
    save_checkpoint(booster, model, optimizer, directory, TrainerState(step=2, plugin="torch_ddp", world_size=2))
    torch.distributed.barrier()
    assert json.loads((directory / "trainer.json").read_text())["step"] == 2
    saved = GPT(CONFIG, seed=9)
    GeneralCheckpointIO().load_model(saved, directory / "model")
    for name, value in saved.state_dict().items():
        assert torch.equal(value, plain.state_dict()[name]), name
    assert not [p.name for p in tmp_path.iterdir() if ".cx-staging-" in p.name]


@distributed(world_size=2)
def test_train_checkpoint_one_run_per_save_folder(rank: int, world_size: int, tmp_path: Path) -> None:
    """A second run saving into a folder another live run holds stops before its first step, on every rank, naming
    the folder and the holder (the two used to clear each other's staging: `FileNotFoundError: 'optimizer'`); once
    the holder ends, the folder is free."""
    save = tmp_path / "ckpt"
    tiny = ["--steps", "1", "--batch-size", "2", "--seq-len", "16", "--hidden-size", "32", "--save", str(save)]
    other = hold_save_folder(save) if rank == 1 else None  # another process holds it: rank 0 must not take it
    torch.distributed.barrier()  # held before rank 0 tries
    with pytest.raises(CheckpointSaveError, match=r"another cx-train run is writing there \(process \d+\)"):
        run(parse_options(tiny, world_size=world_size))
    if other is not None:
        other.close()
    torch.distributed.barrier()
    run(parse_options(tiny, world_size=world_size))
    assert json.loads((save / "trainer.json").read_text())["step"] == 1


@distributed(world_size=2)
def test_train_checkpoint_failed_save_leaves_no_staging(
    rank: int, world_size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that fails (a full disk: ENOSPC from the optimizer's write) raises on every rank and removes its
    staging folder at once (it stayed until the next save), leaving the previous checkpoint whole."""
    booster, _, model, optimizer = boosted("torch_ddp")
    directory = tmp_path / "ckpt"
    train(rank, world_size, booster, model, optimizer, data(1))
    save_checkpoint(booster, model, optimizer, directory, TrainerState(step=1, plugin="torch_ddp", world_size=2))

    def full_disk(self: Booster, *args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Booster, "save_optimizer", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        save_checkpoint(booster, model, optimizer, directory, TrainerState(step=2, plugin="torch_ddp", world_size=2))
    monkeypatch.undo()
    torch.distributed.barrier()
    assert not [p.name for p in tmp_path.iterdir() if ".cx-staging-" in p.name]
    assert json.loads((directory / "trainer.json").read_text())["step"] == 1
