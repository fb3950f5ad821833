"""Checkpoint IO for plugins whose every rank holds the whole model and optimizer (DDP): rank 0 writes, all read.

The files are the canonical cx format (cx_checkpoint.GeneralCheckpointIO), so they load under any plugin and any
world size. Saves end with a barrier so no rank runs ahead of a checkpoint that is still being written; asynchronous
saves are waited for with `synchronize()`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from cx_checkpoint import GeneralCheckpointIO, LoadResult, Stateful
from cx_mesh import DistCoordinator
from cx_plugins._wrappers import ModelWrapper

__all__ = ["ReplicatedCheckpointIO"]


class ReplicatedCheckpointIO(GeneralCheckpointIO):
    """GeneralCheckpointIO where only the master rank writes; loading happens on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self._coordinator = DistCoordinator()

    def save_unsharded_model(
        self, model: nn.Module, checkpoint: Path, gather_dtensor: bool, use_safetensors: bool, use_async: bool
    ) -> None:
        if self._coordinator.is_master():
            super().save_unsharded_model(_plain(model), checkpoint, gather_dtensor, use_safetensors, use_async)
        self._coordinator.block_all()

    def save_sharded_model(
        self,
        model: nn.Module,
        checkpoint: Path,
        gather_dtensor: bool,
        prefix: str | None,
        size_per_shard: float,
        use_safetensors: bool,
        use_async: bool,
    ) -> None:
        if self._coordinator.is_master():
            super().save_sharded_model(
                _plain(model), checkpoint, gather_dtensor, prefix, size_per_shard, use_safetensors, use_async
            )
        self._coordinator.block_all()

    def load_unsharded_model(self, model: nn.Module, checkpoint: Path, strict: bool) -> LoadResult:
        return super().load_unsharded_model(_plain(model), checkpoint, strict)

    def load_sharded_model(self, model: nn.Module, checkpoint: Path, strict: bool) -> LoadResult:
        return super().load_sharded_model(_plain(model), checkpoint, strict)

    def save_unsharded_optimizer(
        self, optimizer: torch.optim.Optimizer, checkpoint: Path, gather_dtensor: bool, use_async: bool
    ) -> None:
        if self._coordinator.is_master():
            super().save_unsharded_optimizer(optimizer, checkpoint, gather_dtensor, use_async)
        self._coordinator.block_all()

    def save_sharded_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        checkpoint: Path,
        gather_dtensor: bool,
        prefix: str | None,
        size_per_shard: float,
        use_async: bool,
    ) -> None:
        if self._coordinator.is_master():
            super().save_sharded_optimizer(optimizer, checkpoint, gather_dtensor, prefix, size_per_shard, use_async)
        self._coordinator.block_all()

    def save_lr_scheduler(self, lr_scheduler: Stateful, checkpoint: str | os.PathLike[str]) -> None:
        if self._coordinator.is_master():
            super().save_lr_scheduler(lr_scheduler, checkpoint)
        self._coordinator.block_all()

    def synchronize(self) -> None:
        """Wait for this rank's asynchronous writes (the master's), then for every rank."""
        super().synchronize()
        self._coordinator.block_all()


def _plain(model: nn.Module) -> nn.Module:
    """The user's module inside a boosted model (DDP and precision wrappers removed)."""
    return model.unwrap() if isinstance(model, ModelWrapper) else model
