"""`accumulated_step`: one optimizer step over several micro-batches, the way every cx plugin accumulates.

Each micro-batch's loss is scaled by 1/N before its backward and all but the last backward run under
`booster.no_sync` (no gradient communication), so with equal-sized micro-batches the step equals one step on their
concatenation (a mean loss over N*b sequences). cx-train trains with it and cx-plan measures it, so the planner's
measured memory and time are those of the step that trains.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from cx_plugins._booster import Booster
from cx_plugins.wrappers._base import OptimizerWrapper

__all__ = ["accumulated_step"]


def accumulated_step(
    booster: Booster,
    model: nn.Module,
    optimizer: OptimizerWrapper,
    batches: Sequence[torch.Tensor],
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    clip: float = 0.0,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Forward and backward over `batches` (one optimizer step), gradients communicated on the last only; then
    clipping (when `clip` > 0; returns the norm before it) and `optimizer.step()` / `zero_grad()`. Returns each
    micro-batch's unscaled loss and the gradient norm."""
    if not batches:
        raise ValueError("accumulated_step needs at least one micro-batch")
    losses: list[torch.Tensor] = []
    scale = 1.0 / len(batches)
    for index, batch in enumerate(batches):
        last = index == len(batches) - 1
        silent = booster.no_sync(model, optimizer) if not last else contextlib.nullcontext()
        with silent:
            loss = forward(model, batch)
            booster.backward(loss * scale if len(batches) > 1 else loss, optimizer)
        losses.append(loss.detach())
    norm = optimizer.clip_grad_by_norm(clip) if clip > 0 else None
    optimizer.step()
    optimizer.zero_grad()
    return losses, None if norm is None else torch.as_tensor(norm)
