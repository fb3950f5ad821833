"""Small helpers every package needs around torch.distributed: the device a group communicates on."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ProcessGroup", "all_gather_flat", "communication_device", "reduce_scatter_flat", "require_initialized"]

ProcessGroup = dist.ProcessGroup


def require_initialized(what: str) -> None:
    """Raise a clear error when distributed work is attempted before `launch`."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed to be initialised first: call cx_mesh.launch(...) or "
            "cx_mesh.launch_from_torch() (or torch.distributed.init_process_group) before it"
        )


def communication_device(group: ProcessGroup | None = None) -> torch.device:
    """The device whose tensors `group`'s backend accepts: the current CUDA device for NCCL, else CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_flat(
    output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
) -> dist.Work | None:
    """All-gather equal-sized tensors into one flat output (rank-major), via `all_gather_single` where torch has it.

    torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single` and warns on the old name; torch 2.4 has only
    the old one. Every cx package gathers through here so that choice lives in one place.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work: dist.Work | None = gather(output, tensor, group=group, async_op=async_op)
    return work


def reduce_scatter_flat(
    output: torch.Tensor,
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce a flat tensor over `group` and keep this rank's equal-sized slice, via `reduce_scatter_single` where
    torch has it (torch 2.13 warns on `reduce_scatter_tensor`; torch 2.4 has only that)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work: dist.Work | None = scatter(output, tensor, op=op, group=group, async_op=async_op)
    return work
