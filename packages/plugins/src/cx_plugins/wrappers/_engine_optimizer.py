"""One boosted optimizer for every plugin whose optimizer is an engine (ZeRO-1/2, Gemini, and the hybrid plugins'):
`EngineOptimizer` routes the Booster's calls to anything with the `OptimizerEngine` face.

`cx_zero.LowLevelZeroOptimizer` and `cx_zero.GeminiOptimizer` satisfy the protocol structurally (no import of this
module); a plugin adds only what its engine has beyond it (ZeRO's master-weight maps, say) in a small subclass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

from cx_plugins.wrappers._base import OptimizerWrapper, finite_or_raise
from cx_zero import BaseGradScaler, DynamicGradScaler

__all__ = ["EngineOptimizer", "OptimizerEngine"]


class OptimizerEngine(Protocol):
    """What the Booster needs from an optimizer engine: backward owns loss scaling and gradient reduction, step owns
    unscaling, clipping and the update; clipping and norms are global over every rank's shards; state dicts are by
    parameter name (collective)."""

    @property
    def grad_scaler(self) -> BaseGradScaler: ...

    @property
    def loss_scale(self) -> float: ...

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None: ...

    def backward_by_grad(
        self,
        tensor: torch.Tensor,
        grad: torch.Tensor,
        inputs: Sequence[torch.Tensor] | None = None,
        retain_graph: bool = False,
    ) -> None: ...

    def step(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> float: ...

    def clip_grad_by_value(self, clip_value: float) -> None: ...

    def get_grad_norm(self) -> float | None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class EngineOptimizer(OptimizerWrapper):
    """The boosted optimizer over an engine; `unwrap()` is still the user's torch optimizer (whose param groups the
    engine steps, so LR schedulers work on it unchanged)."""

    def __init__(self, optimizer: Optimizer, engine: OptimizerEngine) -> None:
        super().__init__(optimizer)
        self.engine = engine

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        self.engine.backward(loss, retain_graph=retain_graph)

    def backward_by_grad(
        self,
        tensor: torch.Tensor,
        grad: torch.Tensor,
        inputs: Sequence[torch.Tensor] | None = None,
        retain_graph: bool = False,
    ) -> None:
        self.engine.backward_by_grad(tensor, grad, inputs=inputs, retain_graph=retain_graph)

    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ValueError(
                f"{type(self.engine).__name__} does not take a closure: call booster.backward(loss, optimizer), then "
                "step()"
            )
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none=set_to_none)

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip by the global norm over every rank's gradient shards (unscaled); returns that norm."""
        norm = self.engine.clip_grad_by_norm(max_norm, norm_type)
        # an fp16 overflow is no error: step() skips it and backs the loss scale off
        dynamic = isinstance(self.engine.grad_scaler, DynamicGradScaler)
        return finite_or_raise(norm, error_if_nonfinite and not dynamic)

    def clip_grad_by_value(self, clip_value: float) -> None:
        self.engine.clip_grad_by_value(clip_value)

    def state_dict(self) -> dict[str, Any]:
        """Full optimizer state by parameter name (collective)."""
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict)

    @property
    def loss_scale(self) -> float:
        return self.engine.loss_scale

    def get_grad_norm(self) -> float | None:
        return self.engine.get_grad_norm()
