"""The global gradient norm kept on the device: ZeRO's step in bf16/fp32 scales and clips with it without reading
it on the host (issue 37); it is read only when asked for (`get_grad_norm`).

Same arithmetic as `norm_or_inf` (a NaN anywhere becomes +inf, so every rank agrees), but nothing leaves the device:
per-tensor weights are applied as Python numbers (no host-to-device copy). When the gradients span several devices,
or a group's communication device is another accelerator than theirs, there is no device to keep it on: None, and
the caller takes `norm_or_inf`'s host path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from cx_mesh import ProcessGroup, all_reduce, communication_device
from cx_zero._norm import NormType

__all__ = ["device_clip_coefficient", "device_norm_or_inf"]


def device_norm_or_inf(
    grads: Sequence[torch.Tensor],
    norm_type: float | str | NormType,
    groups: Sequence[ProcessGroup | None],
    weights: Sequence[float] | None = None,
) -> torch.Tensor | None:
    """The global norm as a one-element float32 tensor on the device (+inf when any rank holds an inf or a nan)."""
    kind = NormType.parse(norm_type)
    factors = [1.0] * len(grads) if weights is None else list(weights)
    by_weight: dict[float, list[torch.Tensor]] = {}
    for grad, weight in zip(grads, factors, strict=True):
        if grad.numel() > 0:
            by_weight.setdefault(weight, []).append(grad.detach())
    reducing = [g for g in groups if dist.get_world_size(g) > 1]
    devices = {t.device for ts in by_weight.values() for t in ts} | {communication_device(g) for g in reducing}
    accelerators = {d for d in devices if d.type != "cpu"}
    if len(accelerators) > 1 or (accelerators and any(d.type == "cpu" for d in devices)):
        return None
    device = accelerators.pop() if accelerators else torch.device("cpu")
    term = torch.zeros((), dtype=torch.float32, device=device)
    order = 2.0 if kind is NormType.TWO else math.inf
    for weight, tensors in by_weight.items():
        norms = torch.stack(torch._foreach_norm(tensors, order, dtype=torch.float32))
        term = term + norms.pow(2).sum() * weight if kind is NormType.TWO else torch.maximum(term, norms.max())
    value = torch.nan_to_num(term, nan=math.inf, posinf=math.inf).reshape(1)
    op = dist.ReduceOp.SUM if kind is NormType.TWO else dist.ReduceOp.MAX
    for group in reducing:
        all_reduce(value, op=op, group=group)
    return value[0].sqrt() if kind is NormType.TWO else value[0]


def device_clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """`clip_coefficient` on the device: min(1, max_norm / (norm + 1e-6)), and 1 for a NaN norm (as min() gives)."""
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return torch.where(torch.isnan(norm), torch.ones_like(coefficient), coefficient)
