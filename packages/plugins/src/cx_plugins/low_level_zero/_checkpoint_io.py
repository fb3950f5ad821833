"""Checkpoint IO for the ZeRO plugins, in the canonical cx format so any plugin at any world size can read it.

Model: weights are replicated on every rank, so the master rank writes them, cast back to the model's own dtypes
(a bf16-trained model saved from an fp32 module is saved in fp32); loading casts into the training precision and
refreshes the optimizer's fp32 masters. Optimizer: the ZeRO optimizer gathers full states by parameter name
(collective), the master rank writes them as cx optimizer parts, the loss scaler's state in the JSON description.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cx_checkpoint import (
    LoadResult,
    OptimizerMeta,
    Region,
    TensorSink,
    TensorSpec,
    require_names,
)
from cx_plugins.checkpoint_io._replicated import ShardedOptimizerCheckpointIO
from cx_plugins.checkpoint_io._state_parts import zero_state_from_parts, zero_state_to_parts
from cx_plugins.wrappers._zero import CastModel
from cx_zero import LowLevelZeroOptimizer

__all__ = ["ZeroCheckpointIO"]


class _CanonicalView(nn.Module):
    """Presents a cast model's state in the model's original dtypes (what the checkpoint stores)."""

    def __init__(self, model: CastModel) -> None:
        super().__init__()
        self._model = model

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        dtypes = self._model.original_dtypes
        state = self._model.unwrap().state_dict()
        return {name: value.to(dtypes.get(name, value.dtype)) for name, value in state.items()}

    def __getattr__(self, name: str) -> Any:
        if name == "config":  # Hugging Face models: their config is written beside the weights
            return self._model.unwrap().config
        return super().__getattr__(name)


class _CastingSink:
    """A TensorSink that expects tensors in the model's original dtypes and copies them into the cast model."""

    def __init__(self, model: CastModel) -> None:
        self._targets = model.unwrap().state_dict(keep_vars=True)
        self._dtypes = model.original_dtypes

    def expected_tensors(self) -> Mapping[str, TensorSpec]:
        return {name: TensorSpec(tuple(t.shape), self._dtypes.get(name, t.dtype)) for name, t in self._targets.items()}

    def owned_region(self, name: str) -> Region | None:
        return None

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            self._targets[name].copy_(tensor)


class ZeroCheckpointIO(ShardedOptimizerCheckpointIO):
    """Replicated weights written by the master rank; ZeRO optimizer state gathered by name, then written."""

    def __init__(
        self,
        zero_of: Callable[[torch.optim.Optimizer], LowLevelZeroOptimizer | None],
        optimizers_of: Callable[[nn.Module], Iterator[LowLevelZeroOptimizer]],
    ) -> None:
        super().__init__()
        self._zero_of = zero_of
        self._optimizers_of = optimizers_of

    # ---- model -------------------------------------------------------------------------------------------------
    def _finish_gathers(self, model: nn.Module) -> None:
        """With `overlap_allgather`, the weights a step wrote are still being gathered until the next forward:
        finish them before a save reads the model, and before a load writes it (else they overwrite the load)."""
        if isinstance(model, CastModel):
            for zero in self._optimizers_of(model.unwrap()):
                zero.synchronize_working_params()

    def _saved_model(self, model: nn.Module) -> nn.Module:
        self._finish_gathers(model)
        return _CanonicalView(model) if isinstance(model, CastModel) else super()._saved_model(model)

    def _model_sink(self, model: nn.Module) -> TensorSink:
        return _CastingSink(model) if isinstance(model, CastModel) else super()._model_sink(model)

    def _load_model(self, model: nn.Module, checkpoint: Path, strict: bool) -> LoadResult:
        self._finish_gathers(model)
        result = super()._load_model(model, checkpoint, strict)
        if isinstance(model, CastModel):  # the fp32 masters follow the loaded weights
            for zero in self._optimizers_of(model.unwrap()):
                zero.update_master_params(model.unwrap())
        return result

    # ---- optimizer ---------------------------------------------------------------------------------------------
    def _zero(self, optimizer: torch.optim.Optimizer) -> LowLevelZeroOptimizer:
        zero = self._zero_of(optimizer)
        if zero is None:
            raise ValueError("this optimizer was not boosted by this plugin: pass the optimizer booster.boost returned")
        return zero

    def _save_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        checkpoint: Path,
        shard: bool,
        prefix: str | None,
        size_per_shard: float,
        use_async: bool,
    ) -> None:
        zero = self._zero(optimizer)
        if shard and not use_async:
            self._stream_sharded(zero, checkpoint, prefix, size_per_shard)
            return
        state = zero.state_dict()  # collective: every rank
        self._write_parts(lambda: zero_state_to_parts(state), checkpoint, shard, prefix, size_per_shard, use_async)

    def _stream_sharded(
        self, zero: LowLevelZeroOptimizer, checkpoint: Path, prefix: str | None, size_per_shard: float
    ) -> None:
        """Full states are gathered a shard's worth at a time and written at once: no rank holds them all."""
        described: dict[str, dict[str, dict[str, Any]]] = {}
        pieces = zero.state_shard(max_shard_size=size_per_shard, only_rank_0=True)  # collective, in step on all ranks

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for piece, _ in pieces:
                for name, values in piece.items():
                    meta, named = zero_state_to_parts({"state": {name: values}, "param_groups": []})
                    described.update(meta.state)
                    yield from named.items()

        def describe() -> OptimizerMeta:  # called after the stream: every state is described by then
            scaler = zero.grad_scaler.state_dict()
            groups, _ = zero_state_to_parts(
                {"state": {}, "param_groups": zero.param_groups_by_name(), "grad_scaler": scaler}
            )
            return OptimizerMeta(groups.param_groups, described)

        self._write_optimizer_stream(checkpoint, tensors(), describe, prefix, size_per_shard)

    def _load_optimizer(self, optimizer: torch.optim.Optimizer, checkpoint: Path, prefix: str | None) -> None:
        meta, tensors = self.load_optimizer_parts(checkpoint, prefix)
        require_names(meta, str(checkpoint))  # ZeRO matches its shards to parameters by name
        self._zero(optimizer).load_state_dict(zero_state_from_parts(meta, tensors))
