"""Distributed gradient norm and clipping over exactly the process groups that hold the gradients.

Each rank passes the gradients (or gradient shards) it holds. The local contribution (sum of squares for the
2-norm, max |g| for the inf-norm) is reduced over each given group in turn, so pass groups whose ranks hold disjoint
parts of the model (e.g. the DP group a ZeRO shard is split over, then the TP group, then the PP group); never a
group whose ranks hold copies of the same gradients. With no groups the norm is the local one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from enum import Enum

import torch
import torch.distributed as dist

from cx_mesh import ProcessGroup, all_reduce, communication_device

__all__ = [
    "NormType",
    "clip_coefficient",
    "clip_grad_norm_",
    "compute_grad_norm",
    "local_norm_term",
    "norm_or_inf",
    "reduce_norm",
]


class NormType(Enum):
    """The norms supported: the 2-norm and the max-norm."""

    TWO = "2"
    INF = "inf"

    @classmethod
    def parse(cls, value: float | str | NormType) -> NormType:
        if isinstance(value, NormType):
            return value
        if isinstance(value, str):
            text = value.strip().lower()
            if text in ("inf", "infinity"):
                return cls.INF
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"unsupported norm type {value!r}: expected 2 or inf") from None
        if value == 2:
            return cls.TWO
        if math.isinf(value) and value > 0:
            return cls.INF
        raise ValueError(f"unsupported norm type {value!r}: expected 2 or inf")


def local_norm_term(
    tensors: Iterable[torch.Tensor],
    norm_type: float | str | NormType = 2.0,
    weights: Sequence[float] | None = None,
) -> torch.Tensor:
    """This rank's float32 contribution: sum of squares (2-norm) or max |x| (inf-norm); 0 for no tensors.

    `weights` (one per tensor) multiply each tensor's sum of squares: a tensor replicated over k ranks of a group
    the term is summed over counts once with weight 1/k. They do not affect the inf-norm."""
    kind = NormType.parse(norm_type)
    items = list(tensors)
    factors = [1.0] * len(items) if weights is None else list(weights)
    if len(factors) != len(items):
        raise ValueError(f"local_norm_term: {len(factors)} weights for {len(items)} tensors")
    by_device: dict[torch.device, list[tuple[torch.Tensor, float]]] = {}
    for t, w in zip(items, factors, strict=True):
        if t.numel() > 0:
            by_device.setdefault(t.device, []).append((t.detach(), w))
    if not by_device:
        return torch.zeros((), dtype=torch.float32)
    order = 2.0 if kind is NormType.TWO else float("inf")
    # Computed in fp32 (an fp16 tensor's norm easily exceeds 65504); one host transfer per device.
    norms = torch.cat(
        [
            torch.stack(torch._foreach_norm([t for t, _ in pairs], order, dtype=torch.float32)).cpu()
            for pairs in by_device.values()
        ]
    )
    if kind is NormType.INF:
        return norms.max()
    scale = torch.tensor([w for pairs in by_device.values() for _, w in pairs], dtype=torch.float32)
    return (norms.pow(2) * scale).sum()


def reduce_norm(
    term: torch.Tensor, norm_type: float | str | NormType = 2.0, groups: Sequence[ProcessGroup | None] = ()
) -> torch.Tensor:
    """Reduce a local term over each group in turn and return the norm (float32 scalar on CPU)."""
    kind = NormType.parse(norm_type)
    value = term.detach().to(torch.float32).reshape(1).clone()
    op = dist.ReduceOp.SUM if kind is NormType.TWO else dist.ReduceOp.MAX
    for group in groups:
        if dist.get_world_size(group) == 1:
            continue
        on_device = value.to(communication_device(group))
        all_reduce(on_device, op=op, group=group)
        value = on_device.cpu()
    result = value[0]
    return result.sqrt() if kind is NormType.TWO else result


def norm_or_inf(
    grads: Iterable[torch.Tensor],
    norm_type: float | str | NormType,
    groups: Sequence[ProcessGroup | None],
    weights: Sequence[float] | None = None,
) -> float:
    """The global norm in one reduction, +inf when any gradient on any rank holds an inf or a nan.

    One reduction answers both ZeRO questions (the fp16 overflow flag is `not isfinite`, the clip factor uses the
    norm). A local NaN becomes +inf before reducing, because a MAX reduction may drop NaNs (comparisons with NaN are
    false) while +inf always wins, so every rank reads the same answer.
    """
    # posinf too: nan_to_num otherwise turns +inf into the largest finite float, and one rank's inf is then missed
    term = torch.nan_to_num(local_norm_term(grads, norm_type, weights), nan=math.inf, posinf=math.inf)
    return float(reduce_norm(term, norm_type, groups))


def compute_grad_norm(
    grads: Iterable[torch.Tensor], norm_type: float | str | NormType = 2.0, groups: Sequence[ProcessGroup | None] = ()
) -> torch.Tensor:
    """The global norm of the gradients held (disjointly) by the ranks of `groups` (module doc)."""
    return reduce_norm(local_norm_term(grads, norm_type), norm_type, groups)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor torch's `clip_grad_norm_` multiplies by: min(1, max_norm / (norm + 1e-6))."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float | str | NormType = 2.0,
    groups: Sequence[ProcessGroup | None] = (),
) -> torch.Tensor:
    """Clip the `.grad` of `parameters` in place by the global norm over `groups`; returns that norm.

    Equals `torch.nn.utils.clip_grad_norm_` on the unsharded model when the ranks hold disjoint parts of it.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    grads = [p.grad for p in parameters if p.grad is not None]
    total = compute_grad_norm(grads, norm_type, groups)
    coefficient = clip_coefficient(float(total), max_norm)
    if coefficient < 1.0 and grads:
        torch._foreach_mul_(grads, coefficient)
    return total
