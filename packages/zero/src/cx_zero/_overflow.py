"""Overflow detection for fp16 training: a local inf/nan check and its OR over the groups holding the gradients."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from cx_mesh import ProcessGroup, all_reduce, communication_device

__all__ = ["any_across_groups", "has_inf_or_nan"]


def has_inf_or_nan(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any element of any tensor is inf or nan (one host sync for all of them)."""
    flags = [torch.logical_not(torch.isfinite(t)).any() for t in tensors if t.numel() > 0]
    if not flags:
        return False
    return bool(torch.stack([f.cpu() for f in flags]).any())


def any_across_groups(flag: bool, groups: Sequence[ProcessGroup | None]) -> bool:
    """OR a boolean over each group in turn (every rank of each group must call this with the same groups)."""
    value = flag
    for group in groups:
        if dist.get_world_size(group) == 1:
            continue
        tensor = torch.tensor([1.0 if value else 0.0], device=communication_device(group))
        all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        value = bool(tensor.item() > 0)
    return value
