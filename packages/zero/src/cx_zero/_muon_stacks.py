"""Muon on a 3-D stack of matrices (an MoE layer's fused experts, (experts, out, in)): each matrix along the leading
dimension is orthogonalised on its own, exactly as torch's Muon would step it as a separate 2-D parameter.

transformers' MoE blocks hold all experts of a layer in one parameter (`experts.gate_up_proj`, `experts.down_proj`);
torch's Muon refuses it (2-D only), and Newton-Schulz on the flattened stack would mix the experts. So the momentum
(elementwise) runs on the whole stack, Newton-Schulz (`torch.optim._muon._zeropower_via_newtonschulz`, the function
torch's Muon calls) on each expert's matrix, and the learning rate is adjusted from the last two dimensions (one
expert's shape), so every expert's update is bit-identical to torch's Muon on that matrix alone. Expert parallelism
splits stacks along the expert dimension, so each rank holds whole experts and steps them exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

__all__ = ["muon_stacks"]


@torch.no_grad()
def muon_stacks(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
) -> None:
    """One Muon step of each 3-D `params[i]` (a stack of matrices) from `grads[i]`, momentum in `buffers[i]`."""
    rate = float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)
    for param, grad, buffer in zip(params, grads, buffers, strict=True):
        if grad.ndim != 3:
            raise ValueError(f"muon_stacks: a stack of matrices is 3-D, got shape {tuple(grad.shape)}")
        buffer.lerp_(grad, 1 - momentum)
        update = grad.lerp(buffer, momentum) if nesterov else buffer
        ortho = torch.stack(
            [_zeropower_via_newtonschulz(matrix, ns_coefficients, ns_steps, eps) for matrix in update.unbind(0)]
        )
        adjusted = _adjust_lr(rate, adjust_lr_fn, param.shape[1:])
        param.mul_(1 - rate * weight_decay)
        param.add_(ortho, alpha=-adjusted)
