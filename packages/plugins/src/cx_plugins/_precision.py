"""Mixed precision as the Booster applies it to plugins that do not control precision themselves (e.g. DDP).

"fp16" runs the forward under autocast(float16) with dynamic loss scaling (torch's GradScaler); "bf16" runs it under
autocast(bfloat16) with no scaling; "fp32" (or None) changes nothing. Parameters and optimizer state stay fp32.
`Precision` itself is cx-zero's (one enum and one `parse` for names and dtypes alike), re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cx_mesh import get_accelerator
from cx_plugins.wrappers._base import ModelWrapper, OptimizerWrapper
from cx_plugins.wrappers._named_phases import UNNAMED, NamedPhases
from cx_zero import Precision

__all__ = ["AutocastModel", "Precision", "ScaledOptimizer"]


class AutocastModel(ModelWrapper):
    """Runs the wrapped module's forward under autocast in the given low precision."""

    def __init__(self, module: nn.Module, precision: Precision) -> None:
        super().__init__(module)
        self.precision = precision

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(get_accelerator().name, dtype=self.precision.dtype):
            return self.module(*args, **kwargs)


class ScaledOptimizer(OptimizerWrapper):
    """fp16 loss scaling around a torch optimizer: scale in backward, unscale and skip on overflow in step."""

    def __init__(self, optimizer: torch.optim.Optimizer, phases: NamedPhases = UNNAMED) -> None:
        super().__init__(optimizer, phases)
        self.scaler = torch.amp.GradScaler(get_accelerator().name)
        self._unscaled = False

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        with self.phases.during(self.phases.backward):
            self.scaler.scale(loss).backward(retain_graph=retain_graph)

    def step(self, closure: Callable[[], float] | None = None) -> None:
        if closure is not None:
            raise ValueError("ScaledOptimizer.step does not take a closure (loss scaling needs backward first)")
        with self.phases.during(self.phases.step):
            self.scaler.step(self.optim)
        self.scaler.update()
        self._unscaled = False

    def _unscale(self) -> None:
        """Clipping works on true gradients: unscale once per step (GradScaler remembers any inf it saw, so the
        step is still skipped on overflow)."""
        if not self._unscaled:
            self.scaler.unscale_(self.optim)
            self._unscaled = True

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        self._unscale()
        return super().clip_grad_by_norm(max_norm, norm_type, error_if_nonfinite)

    def clip_grad_by_value(self, clip_value: float) -> None:
        self._unscale()
        super().clip_grad_by_value(clip_value)

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.get_scale())
