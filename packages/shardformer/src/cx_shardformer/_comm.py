"""Autograd-aware collectives on a tensor- or sequence-parallel group.

Each function is a pair (forward collective, backward collective) chosen so that gradients of replicated and
sharded tensors come out right: e.g. a column layer's input is copied to every rank (identity forward) and its
gradient summed over the group (all-reduce backward). Tensors are split into equal pieces along a dimension; an
uneven size raises a ValueError naming the sizes, the same on every rank, before any collective runs.

With `fp8=True` (ShardConfig's fp8_communication) the collectives go through `cx_mesh.fp8`: forward payloads as
E4M3, gradients as E5M2, each with its scales; `fp8=False` (the default) is the plain path, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cx_mesh import ProcessGroup, all_gather_flat, all_reduce, named_collective, reduce_scatter_flat
from cx_mesh.fp8 import E4M3, E5M2, all_gather_flat_fp8, all_reduce_fp8, all_to_all_single_fp8, reduce_scatter_flat_fp8

__all__ = [
    "all_to_all",
    "copy_to_parallel",
    "gather_forward_reduce_scatter_backward",
    "gather_forward_split_backward",
    "group_rank",
    "group_size",
    "reduce_forward",
    "reduce_scatter_forward_gather_backward",
    "shift_raw",
    "split_forward_gather_backward",
]


Fp8 = torch.dtype | None  # a collective's fp8 payload dtype; None: the plain collective


def _forward_fp8(on: bool) -> Fp8:
    return E4M3 if on else None


def _grad_fp8(on: bool) -> Fp8:
    return E5M2 if on else None


def group_size(group: ProcessGroup | None) -> int:
    """The number of ranks in `group` (the default group when None)."""
    return int(dist.get_world_size(group))


def group_rank(group: ProcessGroup | None) -> int:
    """This rank's index inside `group`."""
    return int(dist.get_rank(group))


def _check_divisible(tensor: torch.Tensor, dim: int, world: int, what: str) -> None:
    if tensor.shape[dim] % world != 0:
        raise ValueError(
            f"{what}: dimension {dim} of a tensor of shape {tuple(tensor.shape)} has size {tensor.shape[dim]}, "
            f"which is not divisible by the group size {world}"
        )


def _gather(tensor: torch.Tensor, dim: int, group: ProcessGroup | None, fp8: Fp8 = None) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim` (rank order); `fp8`: the payload's fp8 dtype (None: plain)."""
    world = group_size(group)
    if world == 1:
        return tensor
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((world * moved.shape[0], *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    if fp8 is None:
        all_gather_flat(out.view(-1), moved.view(-1), group)
    else:
        all_gather_flat_fp8(out.view(-1), moved.view(-1), group, fp8_dtype=fp8)
    return out.movedim(0, dim).contiguous()


def _split(tensor: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's equal piece of `tensor` along `dim`."""
    world = group_size(group)
    if world == 1:
        return tensor
    _check_divisible(tensor, dim, world, "split")
    return tensor.chunk(world, dim)[group_rank(group)].contiguous()


def _reduce_scatter(tensor: torch.Tensor, dim: int, group: ProcessGroup | None, fp8: Fp8 = None) -> torch.Tensor:
    """Sum `tensor` over the group and keep this rank's piece along `dim`."""
    world = group_size(group)
    if world == 1:
        return tensor
    _check_divisible(tensor, dim, world, "reduce-scatter")
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // world, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    if fp8 is None:
        reduce_scatter_flat(out.view(-1), moved.view(-1), group=group)
    else:
        reduce_scatter_flat_fp8(out.view(-1), moved.view(-1), group=group, fp8_dtype=fp8)
    return out.movedim(0, dim).contiguous()


def _all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, fp8: Fp8 = None) -> torch.Tensor:
    if group_size(group) == 1:
        return tensor
    out = tensor.contiguous().clone()
    if fp8 is None:
        all_reduce(out, group=group)
    else:
        all_reduce_fp8(out, group=group, fp8_dtype=fp8)
    return out


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None, fp8: bool) -> torch.Tensor:
        ctx.group, ctx.fp8 = group, fp8
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad, ctx.group, _grad_fp8(ctx.fp8)), None, None


class _ReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None, fp8: bool) -> torch.Tensor:
        return _all_reduce(x, group, _forward_fp8(fp8))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _GatherSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup | None, fp8: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.fp8 = dim, group, fp8
        return _gather(x, dim, group, _forward_fp8(fp8))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _SplitGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup | None, fp8: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.fp8 = dim, group, fp8
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(grad, ctx.dim, ctx.group, _grad_fp8(ctx.fp8)), None, None, None


class _GatherReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup | None, fp8: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.fp8 = dim, group, fp8
        return _gather(x, dim, group, _forward_fp8(fp8))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group, _grad_fp8(ctx.fp8)), None, None, None


class _ReduceScatterGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup | None, fp8: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.fp8 = dim, group, fp8
        return _reduce_scatter(x, dim, group, _forward_fp8(fp8))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(grad, ctx.dim, ctx.group, _grad_fp8(ctx.fp8)), None, None, None


def _all_to_all_raw(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None, fp8: Fp8 = None
) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    _check_divisible(x, scatter_dim, world, "all-to-all")
    pieces = [p.contiguous() for p in x.chunk(world, scatter_dim)]
    send = torch.stack(pieces)  # [world, *piece]
    recv = torch.empty_like(send)
    with named_collective("sequence-parallel all-to-all", group):
        if fp8 is None:
            dist.all_to_all_single(recv, send, group=group)
        else:
            all_to_all_single_fp8(recv, send, group=group, fp8_dtype=fp8)
    return torch.cat(list(recv.unbind(0)), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None, fp8: bool
    ) -> torch.Tensor:
        ctx.dims, ctx.group, ctx.fp8 = (scatter_dim, gather_dim), group, fp8
        return _all_to_all_raw(x, scatter_dim, gather_dim, group, _forward_fp8(fp8))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all_raw(grad, gather_dim, scatter_dim, ctx.group, _grad_fp8(ctx.fp8)), None, None, None, None


def shift_raw(x: torch.Tensor, step: int, group: ProcessGroup | None) -> torch.Tensor:
    """Send `x` to the rank `step` places ahead and return what the rank `step` behind sent (no autograd)."""
    world = group_size(group)
    if world == 1:
        return x
    rank = group_rank(group)
    to_rank = dist.get_global_rank(group, (rank + step) % world) if group is not None else (rank + step) % world
    from_rank = dist.get_global_rank(group, (rank - step) % world) if group is not None else (rank - step) % world
    send = x.contiguous()
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, to_rank, group), dist.P2POp(dist.irecv, recv, from_rank, group)]
    with named_collective("ring attention send/recv", group):
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return recv


def copy_to_parallel(x: torch.Tensor, group: ProcessGroup | None, fp8: bool = False) -> torch.Tensor:
    """Identity forward; the gradient is summed over `group` (input of a column-parallel layer)."""
    out: torch.Tensor = _CopyToParallel.apply(x, group, fp8)
    return out


def reduce_forward(x: torch.Tensor, group: ProcessGroup | None, fp8: bool = False) -> torch.Tensor:
    """Sum over `group` forward; identity backward (output of a row-parallel layer)."""
    out: torch.Tensor = _ReduceForward.apply(x, group, fp8)
    return out


def gather_forward_split_backward(
    x: torch.Tensor, dim: int, group: ProcessGroup | None, fp8: bool = False
) -> torch.Tensor:
    """Concatenate pieces along `dim`; backward keeps this rank's piece (the consumer is replicated)."""
    out: torch.Tensor = _GatherSplit.apply(x, dim, group, fp8)
    return out


def split_forward_gather_backward(
    x: torch.Tensor, dim: int, group: ProcessGroup | None, fp8: bool = False
) -> torch.Tensor:
    """Keep this rank's piece along `dim`; backward concatenates the pieces' gradients."""
    _check_divisible(x, dim, group_size(group), "split")
    out: torch.Tensor = _SplitGather.apply(x, dim, group, fp8)
    return out


def gather_forward_reduce_scatter_backward(
    x: torch.Tensor, dim: int, group: ProcessGroup | None, fp8: bool = False
) -> torch.Tensor:
    """Concatenate sequence pieces forward; backward sums the gradients and keeps this rank's piece (Megatron SP)."""
    out: torch.Tensor = _GatherReduceScatter.apply(x, dim, group, fp8)
    return out


def reduce_scatter_forward_gather_backward(
    x: torch.Tensor, dim: int, group: ProcessGroup | None, fp8: bool = False
) -> torch.Tensor:
    """Sum over the group and keep this rank's piece along `dim`; backward concatenates (Megatron SP)."""
    _check_divisible(x, dim, group_size(group), "reduce-scatter")
    out: torch.Tensor = _ReduceScatterGather.apply(x, dim, group, fp8)
    return out


def all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None, fp8: bool = False
) -> torch.Tensor:
    """Split `scatter_dim` over the group and concatenate the received pieces along `gather_dim` (Ulysses)."""
    _check_divisible(x, scatter_dim, group_size(group), "all-to-all")
    out: torch.Tensor = _AllToAll.apply(x, scatter_dim, gather_dim, group, fp8)
    return out
