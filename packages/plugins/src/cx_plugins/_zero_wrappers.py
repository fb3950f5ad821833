"""Wrappers for ZeRO plugins: a model cast to the training precision, and the ZeRO optimizer behind the Booster."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from cx_plugins._wrappers import ModelWrapper, OptimizerWrapper, finite_or_raise
from cx_zero import DynamicGradScaler, LowLevelZeroOptimizer

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


class ZeroOptimizerWrapper(OptimizerWrapper):
    """Routes backward/step/zero_grad to the ZeRO optimizer; `unwrap()` is still the user's torch optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, zero: LowLevelZeroOptimizer) -> None:
        super().__init__(optimizer)
        self.zero = zero

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.zero.backward(loss, retain_graph=retain_graph)

    def backward_by_grad(
        self,
        tensor: torch.Tensor,
        grad: torch.Tensor,
        inputs: Sequence[torch.Tensor] | None = None,
        retain_graph: bool = False,
    ) -> None:
        self.zero.backward_by_grad(tensor, grad, inputs=inputs, retain_graph=retain_graph)

    def get_working_to_master_map(self) -> dict[int, torch.Tensor]:
        """id(working parameter) -> this rank's fp32 master shard (ColossalAI's LowLevelZero call)."""
        return self.zero.get_working_to_master_map()

    def get_master_to_working_map(self) -> dict[int, torch.nn.Parameter]:
        return self.zero.get_master_to_working_map()

    def update_master_params(self, model: torch.nn.Module) -> None:
        """Copy the model's (working) weights into the masters, e.g. after loading weights into the model."""
        self.zero.update_master_params(model.unwrap() if isinstance(model, ModelWrapper) else model)

    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ValueError(
                "ZeRO optimizers do not take a closure: call booster.backward(loss, optimizer), then step()"
            )
        self.zero.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad(set_to_none=set_to_none)

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip by the global norm over every rank's gradient shard (unscaled); returns that norm."""
        norm = self.zero.clip_grad_by_norm(max_norm, norm_type)
        # an fp16 overflow is no error: step() skips it and backs the loss scale off
        return finite_or_raise(norm, error_if_nonfinite and not isinstance(self.zero.grad_scaler, DynamicGradScaler))

    def clip_grad_by_value(self, clip_value: float) -> None:
        self.zero.clip_grad_by_value(clip_value)

    def state_dict(self) -> dict[str, Any]:
        """Full optimizer state by parameter name (collective)."""
        return self.zero.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.zero.load_state_dict(state_dict)

    @property
    def loss_scale(self) -> float:
        return self.zero.loss_scale

    def get_grad_norm(self) -> float | None:
        return self.zero.get_grad_norm()
