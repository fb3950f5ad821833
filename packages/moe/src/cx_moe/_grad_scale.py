"""`scale_grad`: identity in forward, gradient times a constant in backward.

Expert-parallel layers pass their expert weights through it with factor 1/ep_size. After the combine all-to-all, an
expert's gradient on its owner rank is the sum of the contributions of all ep ranks' tokens; scaled by 1/ep it is
their mean, so averaging it over the moe-dp group (as ZeRO or DDP do over a parameter's data-parallel group) gives
the mean over all data-parallel ranks, the same as a dense parameter averaged over the whole dp group and the same
as the single-process reference. This is what ColossalAI's EP gradient scalers do, kept inside the layer so that
optimizers need no MoE-specific code.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["scale_grad"]


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scale_grad(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """`tensor` unchanged, its gradient multiplied by `factor` (a no-op node when factor is 1)."""
    if factor == 1.0:
        return tensor
    out: torch.Tensor = _ScaleGrad.apply(tensor, factor)
    return out
