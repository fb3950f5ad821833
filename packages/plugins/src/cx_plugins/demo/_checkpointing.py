"""The demo's checkpoints: a directory with the model and optimizer (sharded, safetensors) and `trainer.json`.

`trainer.json` (the step reached, the plugin and world size that wrote it) is written last, atomically, so a
directory without it, or with an older one, never claims a state its weights do not have. Any plugin at any world
size can resume from any other's checkpoint: the files are the canonical cx format.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist
from torch import nn

from cx_plugins._booster import Booster
from cx_plugins._wrappers import OptimizerWrapper

__all__ = ["TrainerState", "load_checkpoint", "save_checkpoint"]

_STATE_FILE = "trainer.json"


@dataclass(frozen=True)
class TrainerState:
    step: int
    plugin: str
    world_size: int


def save_checkpoint(
    booster: Booster, model: nn.Module, optimizer: OptimizerWrapper, directory: Path, state: TrainerState
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    booster.save_model(model, directory / "model", shard=True, use_safetensors=True)
    booster.save_optimizer(optimizer, directory / "optimizer", shard=True)
    booster.synchronize()
    if dist.get_rank() == 0:
        temporary = directory / f".{_STATE_FILE}.tmp"
        temporary.write_text(json.dumps(asdict(state), indent=2))
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, directory / _STATE_FILE)
    dist.barrier()


def load_checkpoint(booster: Booster, model: nn.Module, optimizer: OptimizerWrapper, directory: Path) -> TrainerState:
    state_path = directory / _STATE_FILE
    if not state_path.is_file():
        raise FileNotFoundError(
            f"--resume {directory}: no {_STATE_FILE} there; it is not a complete cx-train checkpoint"
        )
    state = TrainerState(**json.loads(state_path.read_text()))
    booster.load_model(model, directory / "model")
    booster.load_optimizer(optimizer, directory / "optimizer")
    return state
