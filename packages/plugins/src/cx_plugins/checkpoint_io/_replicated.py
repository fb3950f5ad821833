"""Checkpoint IO for plugins whose every rank holds the whole model and optimizer (DDP): rank 0 writes, all read.

The files are the canonical cx format (cx_checkpoint.GeneralCheckpointIO), so they load under any plugin and any
world size. Every save ends with an exchange of outcomes (`run_and_agree`), which is also its barrier: no rank runs
ahead of a checkpoint still being written, and a save that fails on one rank (bad path, full disk, I/O error, an
earlier asynchronous save's error) raises the same `CheckpointSaveError` on every rank, after which training can go
on. Asynchronous saves are waited for with `synchronize()`, which shares its outcome the same way, and by every load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cx_checkpoint import (
    DEFAULT_SIZE_PER_SHARD,
    CheckpointKind,
    CheckpointReader,
    CheckpointSaveError,
    FileFormat,
    GeneralCheckpointIO,
    LoadResult,
    ModuleSink,
    OptimizerMeta,
    Stateful,
    TensorSink,
    file_names,
    load_into,
    restore_optimizer,
    run_and_agree,
    split_optimizer,
    write_sharded,
)
from cx_mesh import DistCoordinator
from cx_plugins._lora import require_lora, save_lora
from cx_plugins.wrappers._base import ModelWrapper

__all__ = [
    "SCALER_KEY",
    "ReplicatedCheckpointIO",
    "ShardedOptimizerCheckpointIO",
    "StateView",
    "split_scaler",
    "with_scaler",
]

SCALER_KEY = "cx_grad_scaler"
"""Where a loss scaler's state rides in a cx optimizer description: a key of param group 0 (plain JSON data)."""


class ReplicatedCheckpointIO(GeneralCheckpointIO):
    """GeneralCheckpointIO where only the master rank writes; loading happens on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self._coordinator = DistCoordinator()
        self._scalers: weakref.WeakKeyDictionary[torch.optim.Optimizer, Stateful] = weakref.WeakKeyDictionary()

    def _on_master(self, step: Callable[[], object], what: str) -> None:
        """`step` on the master rank only; every rank then raises the same error if it failed (collective)."""
        run_and_agree(step if self._coordinator.is_master() else None, what)

    # ---- model: what a save writes and what a load fills are the two adapters a plugin's IO changes -----------
    def _saved_model(self, model: nn.Module) -> nn.Module:
        """The module whose `state_dict()` the master rank writes (collective where a subclass gathers): by default
        the user's module inside the boosted one."""
        return _plain(model)

    def _model_sink(self, model: nn.Module) -> TensorSink:
        """Where a load puts each tensor it reads (every rank): by default straight into the user's module."""
        return ModuleSink(_plain(model))

    def save_unsharded_model(
        self, model: nn.Module, checkpoint: Path, gather_dtensor: bool, use_safetensors: bool, use_async: bool
    ) -> None:
        view = self._saved_model(model)
        self._on_master(
            lambda: super(ReplicatedCheckpointIO, self).save_unsharded_model(
                view, checkpoint, gather_dtensor, use_safetensors, use_async
            ),
            f"saving the model to {checkpoint}",
        )

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
        view = self._saved_model(model)
        self._on_master(
            lambda: super(ReplicatedCheckpointIO, self).save_sharded_model(
                view, checkpoint, gather_dtensor, prefix, size_per_shard, use_safetensors, use_async
            ),
            f"saving the model to {checkpoint}",
        )

    def _load_model(self, model: nn.Module, checkpoint: Path, strict: bool) -> LoadResult:
        """One reader for files, index files and directories alike, into `_model_sink(model)`."""
        with CheckpointReader.open(checkpoint, CheckpointKind.MODEL) as reader:
            return load_into(reader, self._model_sink(model), strict=strict)

    def load_unsharded_model(self, model: nn.Module, checkpoint: Path, strict: bool) -> LoadResult:
        return self._load_model(model, checkpoint, strict)

    def load_sharded_model(self, model: nn.Module, checkpoint: Path, strict: bool) -> LoadResult:
        return self._load_model(model, checkpoint, strict)

    def register_loss_scaler(self, optimizer: torch.optim.Optimizer, scaler: Stateful) -> None:
        """Save and load `scaler`'s state with `optimizer`'s (the Booster registers its fp16 GradScaler here), so an
        fp16 run resumes at the loss scale it had."""
        self._scalers[optimizer] = scaler

    def _save_replicated_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        checkpoint: Path,
        gather_dtensor: bool,
        shard: bool,
        prefix: str | None,
        size_per_shard: float,
        use_async: bool,
    ) -> None:

        def parts() -> tuple[OptimizerMeta, dict[str, torch.Tensor]]:
            meta, tensors = split_optimizer(optimizer, gather_dtensor)
            scaler = self._scalers.get(optimizer)
            return with_scaler(meta, None if scaler is None else scaler.state_dict()), tensors

        self._write_parts(parts, checkpoint, shard, prefix, size_per_shard, use_async)

    def _write_parts(
        self,
        parts: Callable[[], tuple[OptimizerMeta, dict[str, torch.Tensor]]],
        checkpoint: Path,
        shard: bool,
        prefix: str | None,
        size_per_shard: float,
        use_async: bool,
    ) -> None:
        """The master rank builds the optimizer checkpoint's parts (`parts()` runs there only) and writes them; all
        wait, and all raise the same error if it failed."""

        def step() -> None:
            meta, tensors = parts()
            self.save_optimizer_parts(
                meta,
                tensors,
                checkpoint,
                shard=shard,
                prefix=prefix,
                size_per_shard=size_per_shard,
                use_async=use_async,
            )

        self._on_master(step, f"saving the optimizer to {checkpoint}")

    def save_unsharded_optimizer(
        self, optimizer: torch.optim.Optimizer, checkpoint: Path, gather_dtensor: bool, use_async: bool
    ) -> None:
        self._save_replicated_optimizer(
            optimizer, checkpoint, gather_dtensor, False, None, DEFAULT_SIZE_PER_SHARD, use_async
        )

    def save_sharded_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        checkpoint: Path,
        gather_dtensor: bool,
        prefix: str | None,
        size_per_shard: float,
        use_async: bool,
    ) -> None:
        self._save_replicated_optimizer(optimizer, checkpoint, gather_dtensor, True, prefix, size_per_shard, use_async)

    def _load_replicated_optimizer(
        self, optimizer: torch.optim.Optimizer, checkpoint: Path, prefix: str | None
    ) -> None:
        meta, tensors = self.load_optimizer_parts(checkpoint, prefix)
        meta, scaler_state = split_scaler(meta)
        restore_optimizer(optimizer, meta, tensors.__getitem__, str(checkpoint))
        scaler = self._scalers.get(optimizer)
        if scaler is not None and scaler_state is not None:
            scaler.load_state_dict(scaler_state)

    def load_unsharded_optimizer(self, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
        self._load_replicated_optimizer(optimizer, checkpoint, None)

    def load_sharded_optimizer(self, optimizer: torch.optim.Optimizer, checkpoint: Path, prefix: str | None) -> None:
        self._load_replicated_optimizer(optimizer, checkpoint, prefix)

    def save_lora_as_pretrained(
        self, model: nn.Module, checkpoint: str | os.PathLike[str], use_safetensors: bool = False
    ) -> None:
        """The master rank writes the model's LoRA adapters in peft's folder format; every rank waits for it, and
        every rank raises the same error if it failed."""
        require_lora(_plain(model))  # bad input: the same plain error on every rank, before anything is written
        self._on_master(
            lambda: save_lora(_plain(model), checkpoint, use_safetensors), f"saving LoRA adapters to {checkpoint}"
        )

    def save_lr_scheduler(self, lr_scheduler: Stateful, checkpoint: str | os.PathLike[str]) -> None:
        self._on_master(
            lambda: super(ReplicatedCheckpointIO, self).save_lr_scheduler(lr_scheduler, checkpoint),
            f"saving the LR scheduler to {checkpoint}",
        )

    def synchronize(self) -> None:
        """Wait for this rank's asynchronous writes (the master's), then for every rank; an asynchronous save's
        error is raised on every rank."""
        run_and_agree(super().synchronize, "an asynchronous save (reported by synchronize)")

    def _settle_async(self, wait: bool = True) -> None:
        """Collective: every rank waits for its asynchronous writes when `wait` (before a load, so that no rank reads a
        folder the master is still writing), and an asynchronous save's failure on any rank is raised on every rank.
        Then each rank waits for the rest of its writes and drops their errors: the one raised stands for them all,
        and no rank reports a failure later that the others have already raised."""
        try:
            run_and_agree(
                lambda: super(ReplicatedCheckpointIO, self)._settle_async(wait), "an earlier asynchronous save"
            )
        except CheckpointSaveError:
            self._async.drain()
            with contextlib.suppress(Exception):
                self._async.raise_finished_failures()
            raise


def _plain(model: nn.Module) -> nn.Module:
    """The user's module inside a boosted model (DDP and precision wrappers removed)."""
    return model.unwrap() if isinstance(model, ModelWrapper) else model


def with_scaler(meta: OptimizerMeta, scaler_state: Mapping[str, Any] | None) -> OptimizerMeta:
    """`meta` with the loss scaler's state stored in param group 0 (so an fp16 run resumes at the same scale)."""
    if scaler_state is None or not meta.param_groups:
        return meta
    groups = [dict(group) for group in meta.param_groups]
    groups[0][SCALER_KEY] = dict(scaler_state)
    return dataclasses.replace(meta, param_groups=groups)


def split_scaler(meta: OptimizerMeta) -> tuple[OptimizerMeta, dict[str, Any] | None]:
    """The description without the scaler entry, and the scaler's state (None when the checkpoint has none)."""
    scaler = next((group[SCALER_KEY] for group in meta.param_groups if SCALER_KEY in group), None)
    groups = [{k: v for k, v in group.items() if k != SCALER_KEY} for group in meta.param_groups]
    return dataclasses.replace(meta, param_groups=groups), scaler


def states_by_name(meta: OptimizerMeta, tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """param name -> state key -> full value (tensors looked up by their stored names)."""
    return {
        name: {key: tensors[e["tensor"]] if "tensor" in e else e["value"] for key, e in entries.items()}
        for name, entries in meta.state.items()
    }


class ShardedOptimizerCheckpointIO(ReplicatedCheckpointIO, ABC):
    """For plugins whose optimizer state is sharded: subclasses gather it (collectively) and load it back."""

    def _write_optimizer_stream(
        self,
        checkpoint: Path,
        tensors: Iterable[tuple[str, torch.Tensor]],
        describe: Callable[[], OptimizerMeta],
        prefix: str | None,
        size_per_shard: float,
    ) -> None:
        """Write a sharded optimizer checkpoint straight from a collective stream of full state tensors.

        The master rank writes the shard files as the stream yields; the other ranks iterate the same stream (the
        same gathers, in the same order) and keep nothing. `describe()` is called after the stream is consumed,
        so it may describe what the stream produced.
        """
        json_name = file_names(CheckpointKind.OPTIMIZER, FileFormat.SAFETENSORS, prefix).optimizer_json
        stream = iter(tensors)

        def write() -> None:
            self._async.raise_finished_failures()
            write_sharded(
                checkpoint,
                stream,
                kind=CheckpointKind.OPTIMIZER,
                size_per_shard=size_per_shard,
                prefix=prefix,
                extra_files=lambda directory: (directory / json_name).write_text(describe().to_json()),
            )

        self.write_from_stream(write, stream, f"saving the optimizer to {checkpoint}")

    def write_from_stream(self, write: Callable[[], object], stream: Iterator[object], what: str) -> None:
        """The master rank runs `write`, which consumes the collective `stream`; the other ranks drain it. If the
        master fails part-way, it drains the rest too (so every rank makes the same collective calls), and every rank
        then raises the same error."""

        def master() -> None:
            try:
                write()
            except BaseException:
                drain(stream)
                raise

        run_and_agree(master if self._coordinator.is_master() else lambda: drain(stream), what)

    @abstractmethod
    def _save_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        checkpoint: Path,
        shard: bool,
        prefix: str | None,
        size_per_shard: float,
        use_async: bool,
    ) -> None: ...

    @abstractmethod
    def _load_optimizer(self, optimizer: torch.optim.Optimizer, checkpoint: Path, prefix: str | None) -> None: ...

    def save_unsharded_optimizer(
        self, optimizer: torch.optim.Optimizer, checkpoint: Path, gather_dtensor: bool, use_async: bool
    ) -> None:
        self._save_optimizer(optimizer, checkpoint, False, None, DEFAULT_SIZE_PER_SHARD, use_async)

    def save_sharded_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        checkpoint: Path,
        gather_dtensor: bool,
        prefix: str | None,
        size_per_shard: float,
        use_async: bool,
    ) -> None:
        self._save_optimizer(optimizer, checkpoint, True, prefix, size_per_shard, use_async)

    def load_unsharded_optimizer(self, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
        self._load_optimizer(optimizer, checkpoint, None)

    def load_sharded_optimizer(self, optimizer: torch.optim.Optimizer, checkpoint: Path, prefix: str | None) -> None:
        self._load_optimizer(optimizer, checkpoint, prefix)


def drain(stream: Iterable[object]) -> None:
    """Consume a collective stream on a rank that keeps nothing of it."""
    for _ in stream:
        pass


class StateView(nn.Module):
    """A module whose state_dict is a given dict (full tensors a plugin gathered) and whose config is the model's:
    what the single-file writer takes, so a gathered state is written like the model's own."""

    def __init__(self, state: dict[str, torch.Tensor], owner: nn.Module) -> None:
        super().__init__()
        self._state = state
        self._owner = [owner]  # a list, so the owner is not registered as a submodule

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self._state

    def __getattr__(self, name: str) -> Any:
        if name in ("config", "generation_config"):
            return getattr(self._owner[0], name)
        return super().__getattr__(name)
