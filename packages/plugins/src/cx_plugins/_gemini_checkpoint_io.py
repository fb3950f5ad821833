"""Checkpoint IO for the Gemini plugin, in the canonical cx format (full tensors by name, original dtypes).

Gemini's parameters and optimizer state are sharded, so saving is collective: GeminiDDP / GeminiOptimizer stream
full tensors (`TensorSource`), a bounded amount at a time, and only the saving rank (rank 0) writes; sharded saves
go straight from the stream into shard files, so no rank ever holds the whole model. Loading is `TensorSink`: every
rank reads each full tensor lazily and keeps its part. The loss scaler's state rides in the optimizer description.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cx_checkpoint import (
    DEFAULT_SIZE_PER_SHARD,
    CheckpointKind,
    CheckpointReader,
    FileFormat,
    GeneralCheckpointIO,
    LoadResult,
    OptimizerMeta,
    file_names,
    hf_side_files,
    iter_source,
    load_into,
    write_sharded,
    write_side_files,
)
from cx_mesh import DistCoordinator
from cx_plugins._wrappers import ModelWrapper
from cx_zero import GeminiDDP, GeminiOptimizer

__all__ = ["GeminiCheckpointIO"]

_SCALER_KEY = "cx_grad_scaler"


class _StateView(nn.Module):
    """A module whose state_dict is a given dict (the gathered full tensors) and whose config is the model's."""

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


def _bytes(size_per_shard_mb: float) -> int:
    return max(1, int(size_per_shard_mb * 1024 * 1024))


def _drain(stream: Iterable[object]) -> None:
    for _ in stream:
        pass


class GeminiCheckpointIO(GeneralCheckpointIO):
    def __init__(self, gemini_of: Callable[[torch.optim.Optimizer], GeminiOptimizer | None]) -> None:
        super().__init__()
        self._gemini_of = gemini_of
        self._coordinator = DistCoordinator()

    # ---- model -------------------------------------------------------------------------------------------------
    @staticmethod
    def _ddp(model: nn.Module) -> GeminiDDP:
        inner = model.module if isinstance(model, ModelWrapper) else model
        if not isinstance(inner, GeminiDDP):
            raise ValueError("GeminiCheckpointIO needs the model returned by booster.boost with the GeminiPlugin")
        return inner

    def save_unsharded_model(
        self, model: nn.Module, checkpoint: Path, gather_dtensor: bool, use_safetensors: bool, use_async: bool
    ) -> None:
        ddp = self._ddp(model)
        state = ddp.state_dict(only_rank_0=True)  # collective; full CPU tensors on the saving rank only
        if self._coordinator.is_master():
            super().save_unsharded_model(
                _StateView(state, ddp.unwrap()), checkpoint, gather_dtensor, use_safetensors, use_async
            )
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
        ddp = self._ddp(model)
        if use_async:  # the writer thread cannot take part in collectives: gather now, write in the background
            state = ddp.state_dict(only_rank_0=True)
            if self._coordinator.is_master():
                super().save_sharded_model(
                    _StateView(state, ddp.unwrap()),
                    checkpoint,
                    gather_dtensor,
                    prefix,
                    size_per_shard,
                    use_safetensors,
                    use_async,
                )
            self._coordinator.block_all()
            return
        stream = iter_source(ddp, _bytes(size_per_shard))
        if self._coordinator.is_master():
            side = hf_side_files(ddp.unwrap())
            write_sharded(
                checkpoint,
                stream,
                kind=CheckpointKind.MODEL,
                file_format=FileFormat.SAFETENSORS if use_safetensors else FileFormat.BIN,
                size_per_shard=size_per_shard,
                prefix=prefix,
                extra_files=lambda directory: write_side_files(directory, side),
            )
        else:
            _drain(stream)  # the same collectives, in the same order, as the writing rank's stream
        self._coordinator.block_all()

    def _load_model(self, model: nn.Module, checkpoint: Path, strict: bool) -> LoadResult:
        with CheckpointReader.open(checkpoint, CheckpointKind.MODEL) as reader:
            return load_into(reader, self._ddp(model), strict=strict)

    def load_unsharded_model(self, model: nn.Module, checkpoint: Path, strict: bool) -> LoadResult:
        return self._load_model(model, checkpoint, strict)

    def load_sharded_model(self, model: nn.Module, checkpoint: Path, strict: bool) -> LoadResult:
        return self._load_model(model, checkpoint, strict)

    # ---- optimizer ---------------------------------------------------------------------------------------------
    def _gemini(self, optimizer: torch.optim.Optimizer) -> GeminiOptimizer:
        gemini = self._gemini_of(optimizer)
        if gemini is None:
            raise ValueError("this optimizer was not boosted by the GeminiPlugin: pass the one booster.boost returned")
        return gemini

    def _meta(self, gemini: GeminiOptimizer) -> OptimizerMeta:
        meta = gemini.checkpoint_meta()  # collective
        groups = [dict(group) for group in meta.param_groups]
        if groups:
            groups[0][_SCALER_KEY] = gemini.scaler.state_dict()
        return OptimizerMeta(groups, meta.state)

    def _save_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        checkpoint: Path,
        shard: bool,
        prefix: str | None,
        size_per_shard: float,
        use_async: bool,
    ) -> None:
        gemini = self._gemini(optimizer)
        meta = self._meta(gemini)
        stream = iter_source(gemini, _bytes(size_per_shard))
        if not self._coordinator.is_master():
            _drain(stream)
        elif shard and not use_async:
            json_name = file_names(CheckpointKind.OPTIMIZER, FileFormat.SAFETENSORS, prefix).optimizer_json
            text = meta.to_json()
            write_sharded(
                checkpoint,
                stream,
                kind=CheckpointKind.OPTIMIZER,
                size_per_shard=size_per_shard,
                prefix=prefix,
                extra_files=lambda directory: (directory / json_name).write_text(text),
            )
        else:
            tensors = dict(stream)
            self.save_optimizer_parts(
                meta,
                tensors,
                checkpoint,
                shard=shard,
                prefix=prefix,
                size_per_shard=size_per_shard,
                use_async=use_async,
            )
        self._coordinator.block_all()

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

    def _load_optimizer_from(
        self, optimizer: torch.optim.Optimizer, checkpoint: str | os.PathLike[str], prefix: str | None
    ) -> None:
        gemini = self._gemini(optimizer)
        meta, tensors = self.load_optimizer_parts(checkpoint, prefix)
        scaler: dict[str, Any] | None = None
        groups = []
        for group in meta.param_groups:
            scaler = scaler or group.get(_SCALER_KEY)
            groups.append({k: v for k, v in group.items() if k != _SCALER_KEY})
        state = {
            name: {key: tensors[e["tensor"]] if "tensor" in e else e["value"] for key, e in entries.items()}
            for name, entries in meta.state.items()
        }
        state = {name: {k: v for k, v in entries.items() if k != "master_weight"} for name, entries in state.items()}
        gemini.load_state_dict({"state": state, "param_groups": groups})
        if scaler is not None:
            gemini.scaler.load_state_dict(scaler)

    def load_unsharded_optimizer(self, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
        self._load_optimizer_from(optimizer, checkpoint, None)

    def load_sharded_optimizer(self, optimizer: torch.optim.Optimizer, checkpoint: Path, prefix: str | None) -> None:
        self._load_optimizer_from(optimizer, checkpoint, prefix)

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        if self._coordinator.is_master():
            super().save_lr_scheduler(lr_scheduler, checkpoint)
        self._coordinator.block_all()

    def synchronize(self) -> None:
        super().synchronize()
        self._coordinator.block_all()
