"""What a schedule needs from an optimizer: ColossalAI's backward contract, so ZeRO's loss scaling and gradient
reduction happen inside the pipeline's backward passes.

- The last stage calls `optimizer.backward(loss)`; the others `optimizer.backward_by_grad(tensor, grad)` with the
  (already scaled) gradient received from the next stage, a list of tensors when a stage sends several.
- An optimizer with `no_sync()` (a context manager) gets every backward of a step but the rank's last inside it,
  so gradients are reduced once per step, not once per micro-batch.
- The zero-bubble schedule splits each backward in two and, with an optimizer, uses the `inputs=` and
  `retain_graph=` keywords of both methods (input gradients first, then the weight gradients), as ColossalAI's
  zero-bubble schedule does.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from cx_pipeline._errors import PipelineConfigError

__all__ = ["PipelineOptimizer", "no_sync_context", "require_split_backward"]


@runtime_checkable
class PipelineOptimizer(Protocol):
    def backward(self, loss: torch.Tensor) -> None: ...

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None: ...


def no_sync_context(optimizer: object | None) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
    """The optimizer's `no_sync` context factory, or None when it has none (then nothing is deferred)."""
    no_sync = getattr(optimizer, "no_sync", None)
    return no_sync if callable(no_sync) else None


def _accepts(function: Callable[..., Any], *names: str) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return True
    return all(name in parameters for name in names)


def require_split_backward(optimizer: object) -> None:
    """The zero-bubble schedule with an optimizer needs `inputs=` / `retain_graph=` on both backward methods."""
    missing = [
        name
        for name in ("backward", "backward_by_grad")
        if not callable(getattr(optimizer, name, None))
        or not _accepts(getattr(optimizer, name), "inputs", "retain_graph")
    ]
    if missing:
        raise PipelineConfigError(
            f"the zero-bubble V schedule splits each backward into input- and weight-gradient passes, so the "
            f"optimizer's {' and '.join(missing)} must accept inputs= and retain_graph= keywords (as ColossalAI's "
            f"zero-bubble optimizers do); {type(optimizer).__name__} does not. Use OneForwardOneBackwardSchedule or "
            "InterleavedSchedule with it, or pass optimizer=None and step the optimizer after forward_backward_step"
        )
