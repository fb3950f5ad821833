"""Wrappers the Booster hands back: a model that knows how to unwrap itself and an optimizer that owns backward.

Owning backward in the optimizer is what lets mixed precision (loss scaling) and ZeRO (gradient reduction) plug in
without the training loop changing: the loop always calls `booster.backward(loss, optimizer)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from cx_plugins.wrappers._named_phases import UNNAMED, NamedPhases

__all__ = ["ModelWrapper", "OptimizerWrapper", "finite_or_raise"]


class ModelWrapper(nn.Module):
    """A boosted model: forwards to the wrapped module; `unwrap()` returns the user's original module. `phases` names
    what the plugin's forward communicates inside torch (its errors then name the group and rank)."""

    def __init__(self, module: nn.Module, phases: NamedPhases = UNNAMED) -> None:
        super().__init__()
        self.module = module
        self.phases = phases

    def unwrap(self) -> nn.Module:
        inner = self.module
        return inner.unwrap() if isinstance(inner, ModelWrapper) else _strip_ddp(inner)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.phases.during(self.phases.forward):
            return self.module(*args, **kwargs)


def _strip_ddp(module: nn.Module) -> nn.Module:
    inner = getattr(module, "module", None)
    if isinstance(module, torch.nn.parallel.DistributedDataParallel) and isinstance(inner, nn.Module):
        return inner
    return module


class OptimizerWrapper:
    """A boosted optimizer: `backward(loss)`, `step()`, `zero_grad()`, and the torch optimizer's public face.
    `phases` names what the plugin's backward and step communicate inside torch (DDP's gradient all-reduce)."""

    def __init__(self, optimizer: Optimizer, phases: NamedPhases = UNNAMED) -> None:
        self.optim = optimizer
        self.phases = phases

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def state(self) -> Any:
        return self.optim.state

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        with self.phases.during(self.phases.backward):
            loss.backward(retain_graph=retain_graph)

    def backward_by_grad(
        self,
        tensor: torch.Tensor,
        grad: torch.Tensor,
        inputs: Sequence[torch.Tensor] | None = None,
        retain_graph: bool = False,
    ) -> None:
        """Backward from an intermediate `tensor` with its upstream `grad`, used as given (ColossalAI's call; a
        pipeline stage's upstream gradient already carries any loss scale)."""
        with self.phases.during(self.phases.backward):
            torch.autograd.backward(tensor, grad, inputs=inputs, retain_graph=retain_graph)

    def step(self, closure: Callable[[], float] | None = None) -> None:
        with self.phases.during(self.phases.step):
            self.optim.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def _params_with_grad(self) -> list[torch.Tensor]:
        return [p for group in self.optim.param_groups for p in group["params"] if p.grad is not None]

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Call between backward and step: scale the gradients so that their total norm is at most `max_norm`
        (`torch.nn.utils.clip_grad_norm_`; the gradients are replicated, so the local norm is the global one).
        Returns the norm before clipping."""
        if not max_norm > 0 or math.isinf(max_norm):
            raise ValueError(f"clip_grad_by_norm: max_norm must be a positive number, got {max_norm}")
        return torch.nn.utils.clip_grad_norm_(self._params_with_grad(), max_norm, norm_type, error_if_nonfinite)

    def clip_grad_by_value(self, clip_value: float) -> None:
        """Call between backward and step: clamp every gradient element into [-clip_value, clip_value]."""
        if not clip_value > 0 or math.isinf(clip_value):
            raise ValueError(f"clip_grad_by_value: clip_value must be a positive number, got {clip_value}")
        torch.nn.utils.clip_grad_value_(self._params_with_grad(), clip_value)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def unwrap(self) -> Optimizer:
        return self.optim


def finite_or_raise(norm: float, check: bool) -> torch.Tensor:
    """`norm` as a tensor (what torch's clip_grad_norm_ returns); with `check`, an error when it is inf or nan."""
    if check and not math.isfinite(norm):
        raise RuntimeError(f"the total norm of the gradients is {norm}: clipping is not possible (error_if_nonfinite)")
    return torch.tensor(norm)
