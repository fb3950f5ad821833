"""Checkpoint IO for the Gemini plugin, in the canonical cx format (full tensors by name, original dtypes).

Gemini's parameters and optimizer state are sharded, so saving is collective: GeminiDDP / GeminiOptimizer stream
full tensors (`TensorSource`), a bounded amount at a time, and only the saving rank (rank 0) writes; sharded saves
go straight from the stream into shard files, so no rank ever holds the whole model. Loading is `TensorSink`: every
rank reads each full tensor lazily and keeps its part. The loss scaler's state rides in the optimizer description.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cx_checkpoint import (
    CheckpointKind,
    FileFormat,
    TensorSink,
    TensorSource,
    hf_side_files,
    iter_source,
    require_names,
    write_sharded,
    write_side_files,
)
from cx_plugins._lora import require_lora, save_lora
from cx_plugins.checkpoint_io._replicated import (
    ShardedOptimizerCheckpointIO,
    StateView,
    split_scaler,
    states_by_name,
    with_scaler,
)
from cx_plugins.wrappers._base import ModelWrapper
from cx_zero import GeminiDDP, GeminiOptimizer

__all__ = ["GeminiCheckpointIO"]


def _bytes(size_per_shard_mb: float) -> int:
    return max(1, int(size_per_shard_mb * 1024 * 1024))


class GeminiCheckpointIO(ShardedOptimizerCheckpointIO):
    def __init__(self, gemini_of: Callable[[torch.optim.Optimizer], GeminiOptimizer | None]) -> None:
        super().__init__()
        self._gemini_of = gemini_of

    # ---- what is saved and loaded (subclasses adapt it: tensor-parallel shards) ------------------------------
    def _full_model_state(self, ddp: GeminiDDP) -> dict[str, torch.Tensor]:
        return ddp.state_dict(only_rank_0=True)  # collective; full CPU tensors on the saving rank only

    def _model_source(self, ddp: GeminiDDP) -> TensorSource:
        return ddp

    def _ddp_sink(self, ddp: GeminiDDP) -> TensorSink:
        return ddp

    def _model_sink(self, model: nn.Module) -> TensorSink:
        return self._ddp_sink(self._ddp(model))

    def _optimizer_source(self, gemini: GeminiOptimizer) -> TensorSource:
        return gemini

    def _local_states(self, gemini: GeminiOptimizer, states: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
        return dict(states)

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
        state = self._full_model_state(ddp)
        # the replicated path: the master rank writes, every rank waits for it
        super().save_unsharded_model(
            StateView(state, ddp.unwrap()), checkpoint, gather_dtensor, use_safetensors, use_async
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
        ddp = self._ddp(model)
        if use_async:  # the writer thread cannot take part in collectives: gather now, write in the background
            state = self._full_model_state(ddp)
            view = StateView(state, ddp.unwrap())
            super().save_sharded_model(view, checkpoint, gather_dtensor, prefix, size_per_shard, use_safetensors, True)
            return
        stream = iter_source(self._model_source(ddp), _bytes(size_per_shard))
        side = hf_side_files(ddp.unwrap()) if self._coordinator.is_master() else {}

        def write() -> None:
            self._async.raise_finished_failures()
            write_sharded(
                checkpoint,
                stream,
                kind=CheckpointKind.MODEL,
                file_format=FileFormat.SAFETENSORS if use_safetensors else FileFormat.BIN,
                size_per_shard=size_per_shard,
                prefix=prefix,
                extra_files=lambda directory: write_side_files(directory, side),
            )

        # the other ranks drain the stream: the same collectives, in the same order, as the writing rank's
        self.write_from_stream(write, stream, f"saving the model to {checkpoint}")

    def save_lora_as_pretrained(
        self, model: nn.Module, checkpoint: str | os.PathLike[str], use_safetensors: bool = False
    ) -> None:
        """The model's full state gathered from the chunks (and tp slices) onto the saving rank (collective), its
        adapters written there in peft's folder format; every rank raises the same error on failure."""
        ddp = self._ddp(model)
        require_lora(ddp.unwrap())  # the same plain error on every rank, before any collective
        self._settle_async()
        adapters = {name: t for name, t in self._full_model_state(ddp).items() if "lora_" in name}
        self._on_master(
            lambda: save_lora(ddp.unwrap(), checkpoint, use_safetensors, adapters),
            f"saving LoRA adapters to {checkpoint}",
        )

    # ---- optimizer ---------------------------------------------------------------------------------------------
    def _gemini(self, optimizer: torch.optim.Optimizer) -> GeminiOptimizer:
        gemini = self._gemini_of(optimizer)
        if gemini is None:
            raise ValueError("this optimizer was not boosted by the GeminiPlugin: pass the one booster.boost returned")
        return gemini

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
        meta = with_scaler(gemini.checkpoint_meta(), gemini.scaler.state_dict())  # collective
        stream = iter_source(self._optimizer_source(gemini), _bytes(size_per_shard))
        if shard and not use_async:  # straight from the owners' stream into shard files
            self._write_optimizer_stream(checkpoint, stream, lambda: meta, prefix, size_per_shard)
            return
        tensors = dict(stream)  # collective; empty except on the saving rank
        self._write_parts(lambda: (meta, tensors), checkpoint, shard, prefix, size_per_shard, use_async)

    def _load_optimizer(self, optimizer: torch.optim.Optimizer, checkpoint: Path, prefix: str | None) -> None:
        meta, tensors = self.load_optimizer_parts(checkpoint, prefix)
        require_names(meta, str(checkpoint))  # Gemini matches its shards to parameters by name
        meta, scaler = split_scaler(meta)
        # LowLevelZero checkpoints also carry fp32 master copies; Gemini's masters come from the model checkpoint
        state = {
            name: {key: value for key, value in entries.items() if key != "master_weight"}
            for name, entries in states_by_name(meta, tensors).items()
        }
        gemini = self._gemini(optimizer)
        gemini.load_state_dict({"state": self._local_states(gemini, state), "param_groups": meta.param_groups})
        if scaler is not None:
            gemini.scaler.load_state_dict(scaler)
