"""Wrappers for the ZeRO-1/2 plugin: a model cast to the training precision, and the ZeRO engine's boosted optimizer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from cx_plugins.wrappers._base import ModelWrapper
from cx_plugins.wrappers._engine_optimizer import EngineOptimizer
from cx_zero import LowLevelZeroOptimizer

__all__ = ["CastModel", "ZeroOptimizerWrapper"]


class CastModel(ModelWrapper):
    """The module with its floating parameters and buffers in `dtype`; floating inputs cast too when asked.

    `original_dtypes` remembers each floating tensor's dtype before the cast, so checkpoints are written in the
    model's own precision (the canonical cx format), whatever precision it trained in.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype, cast_inputs: bool) -> None:
        self.original_dtypes = {name: t.dtype for name, t in module.state_dict(keep_vars=True).items()}
        if dtype != torch.float32:
            module = module.to(dtype)
        super().__init__(module)
        self.dtype = dtype
        self.cast_inputs = cast_inputs and dtype != torch.float32

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.cast_inputs:
            args, kwargs = tree_map(self._cast, (args, kwargs))
        return self.module(*args, **kwargs)

    def _cast(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.dtype)
        return value


class ZeroOptimizerWrapper(EngineOptimizer):
    """The boosted optimizer over a `LowLevelZeroOptimizer` (the engine, also `.zero`), with ColossalAI's
    LowLevelZero extras: the working/master parameter maps and refreshing the masters from the model."""

    def __init__(self, optimizer: torch.optim.Optimizer, zero: LowLevelZeroOptimizer) -> None:
        super().__init__(optimizer, zero)
        self.zero = zero

    def get_working_to_master_map(self) -> dict[int, torch.Tensor]:
        """id(working parameter) -> this rank's fp32 master shard (ColossalAI's LowLevelZero call)."""
        return self.zero.get_working_to_master_map()

    def get_master_to_working_map(self) -> dict[int, torch.nn.Parameter]:
        return self.zero.get_master_to_working_map()

    def update_master_params(self, model: torch.nn.Module) -> None:
        """Copy the model's (working) weights into the masters, e.g. after loading weights into the model."""
        self.zero.update_master_params(model.unwrap() if isinstance(model, ModelWrapper) else model)
