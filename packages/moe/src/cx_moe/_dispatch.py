"""Token dispatch and combine across an expert-parallel group (experts split into equal contiguous ranges:
rank r owns experts [r * E_local, (r + 1) * E_local)).

Dropless (`dispatch` / `combine`): each rank sorts its (token, slot) assignments by expert, so they are grouped by
owner rank; the per-expert counts go first through one small `all_to_all_single` (the only host sync), then the token
rows through an uneven `all_to_all_single` under autograd (`_Exchange`: its backward is the reverse exchange). Both
go through cx-mesh's named all-to-all: a stuck peer gives a `CollectiveTimeoutError` naming the expert-parallel group,
a failed one a `PeerFailedError` naming that rank (within about a second on gloo), not a bare transport timeout.
The receiver regroups the rows by local expert for the grouped matmul; `combine` undoes each step and sums each
token's k outputs with its routing weights. Empty splits (an expert nobody routes to, a rank with no tokens)
are ordinary zero-size pieces.

Padded (`dispatch_padded` / `combine_padded`): with a capacity, each expert gets exactly `capacity` rows from each
rank (zeros where unused), so the exchange has fixed, equal splits and needs no count exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cx_mesh import ProcessGroup, all_to_all_single
from cx_mesh import fp8 as cx_fp8

__all__ = ["DispatchPlan", "combine", "combine_padded", "dispatch", "dispatch_padded", "group_size"]


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_to_all(
    rows: torch.Tensor,
    out_sizes: list[int],
    in_sizes: list[int],
    group: ProcessGroup,
    fp8_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Rows to every rank (`in_sizes` of them to each, in rank order); `out_sizes` rows come back from each. With
    `fp8_dtype` the rows travel in that fp8 format (scales alongside) and arrive in their own dtype."""
    rows = rows.contiguous()
    received = rows.new_empty((sum(out_sizes), *rows.shape[1:]))
    if fp8_dtype is None:
        all_to_all_single(received, rows, out_sizes, in_sizes, group=group)
    else:
        cx_fp8.all_to_all_single_fp8(received, rows, out_sizes, in_sizes, group=group, fp8_dtype=fp8_dtype)
    return received


class _Exchange(torch.autograd.Function):
    """The uneven row exchange under autograd: the gradient goes back by the reverse exchange (in fp8: E4M3 rows
    forward, E5M2 gradients back)."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: ProcessGroup, fp8: bool
    ) -> torch.Tensor:
        ctx.sizes, ctx.group, ctx.fp8 = (out_sizes, in_sizes), group, fp8
        return _all_to_all(rows, out_sizes, in_sizes, group, cx_fp8.E4M3 if fp8 else None)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        out_sizes, in_sizes = ctx.sizes
        returned = _all_to_all(grad, in_sizes, out_sizes, ctx.group, cx_fp8.E5M2 if ctx.fp8 else None)
        return returned, None, None, None, None


def _exchange(
    rows: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: ProcessGroup, fp8: bool
) -> torch.Tensor:
    result: torch.Tensor = _Exchange.apply(rows, out_sizes, in_sizes, group, fp8)
    return result


def _check_fp8_communication(fp8_communication: bool, group: ProcessGroup | None) -> None:
    if fp8_communication and group_size(group) == 1:
        raise ValueError(
            "fp8_communication=True needs an expert-parallel group of more than one rank: without one, dispatch and "
            "combine exchange nothing to compress"
        )


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


@dataclass(frozen=True)
class DispatchPlan:
    """What `combine` needs to bring expert outputs back: the sort of the local assignments, the positions of the
    kept ones, the split sizes and the regrouping of received rows."""

    num_tokens: int
    top_k: int
    kept_positions: torch.Tensor  # flat (token * k + slot) of every dispatched assignment, in send order
    send_sizes: list[int]
    recv_sizes: list[int]
    regroup: torch.Tensor | None  # received row order -> expert-major order (None without exchange)
    group: ProcessGroup | None
    capacity: int = 0  # padded layout only
    padded_rows: torch.Tensor | None = None  # padded layout only: row of each kept assignment in the send buffer
    fp8_communication: bool = False  # the row exchanges of dispatch and combine in fp8


def dispatch(
    x: torch.Tensor,
    indices: torch.Tensor,
    num_experts: int,
    group: ProcessGroup | None,
    keep: torch.Tensor | None = None,
    fp8_communication: bool = False,
) -> tuple[torch.Tensor, list[int], DispatchPlan]:
    """Send every kept assignment's token row to its expert's rank. Returns the rows this rank's experts compute,
    grouped by local expert, the count per local expert, and the plan for `combine`. `fp8_communication`: the row
    exchanges (here and in `combine`) in fp8; an error without an expert-parallel group (nothing to compress)."""
    _check_fp8_communication(fp8_communication, group)
    tokens, top_k = indices.shape
    ep = group_size(group)
    flat = indices.reshape(-1)
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, num_experts)  # dropped: a sentinel that sorts last
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    if ep == 1 or group is None:
        local_counts = counts.tolist()
        kept = order[: sum(local_counts)]
        rows = x[kept // top_k]
        return rows, local_counts, DispatchPlan(tokens, top_k, kept, [], [], None, None)
    local = num_experts // ep
    send_counts = counts.view(ep, local)
    recv_counts = torch.empty_like(send_counts)
    all_to_all_single(recv_counts, send_counts, group=group)
    both = torch.stack([send_counts, recv_counts]).tolist()  # the one host sync of the layer
    send_sizes = [sum(r) for r in both[0]]
    recv_sizes = [sum(r) for r in both[1]]
    kept = order[: sum(send_sizes)]
    received = _exchange(x[kept // top_k], recv_sizes, send_sizes, group, fp8_communication)
    expert_of_row = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
    regroup = torch.argsort(expert_of_row, stable=True)
    local_counts = [sum(both[1][src][e] for src in range(ep)) for e in range(local)]
    plan = DispatchPlan(tokens, top_k, kept, send_sizes, recv_sizes, regroup, group, 0, None, fp8_communication)
    return received[regroup], local_counts, plan


def _weighted_sum(per_assignment: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor) -> torch.Tensor:
    """Rows of the kept assignments -> [T, H]: each token's expert outputs times its routing weights, summed over
    its k slots in fp32 (dropped slots contribute nothing)."""
    hidden = per_assignment.shape[-1]
    full = per_assignment.new_zeros(plan.num_tokens * plan.top_k, hidden)
    full = full.index_copy(0, plan.kept_positions, per_assignment)
    weighted = full.view(plan.num_tokens, plan.top_k, hidden).float() * weights.unsqueeze(-1).float()
    return weighted.sum(dim=1).to(per_assignment.dtype)


def combine(expert_out: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor) -> torch.Tensor:
    """Inverse of `dispatch`, then each token's routing-weighted sum: [T, H]."""
    if plan.group is None or plan.regroup is None:
        return _weighted_sum(expert_out, plan, weights)
    in_recv_order = expert_out[_inverse(plan.regroup)]
    returned = _exchange(in_recv_order, plan.send_sizes, plan.recv_sizes, plan.group, plan.fp8_communication)
    return _weighted_sum(returned, plan, weights)


def dispatch_padded(
    x: torch.Tensor,
    indices: torch.Tensor,
    num_experts: int,
    group: ProcessGroup | None,
    keep: torch.Tensor,
    slots: torch.Tensor,
    capacity: int,
    fp8_communication: bool = False,
) -> tuple[torch.Tensor, list[int], DispatchPlan]:
    """Like `dispatch`, into a fixed `[num_experts, capacity]` buffer per rank (`slots`: each assignment's place in
    its expert's rows, only read where `keep`). Every local expert then gets `ep * capacity` rows."""
    _check_fp8_communication(fp8_communication, group)
    tokens, top_k = indices.shape
    ep = group_size(group)
    local = num_experts // ep
    kept = torch.nonzero(keep.reshape(-1)).squeeze(-1)
    rows_at = indices.reshape(-1)[kept] * capacity + slots.reshape(-1)[kept]
    buffer = x.new_zeros(num_experts * capacity, x.shape[-1]).index_copy(0, rows_at, x[kept // top_k])
    counts = [ep * capacity] * local
    if ep == 1 or group is None:
        plan = DispatchPlan(tokens, top_k, kept, [], [], None, None, capacity, rows_at)
        return buffer, counts, plan
    sizes = [local * capacity] * ep
    received = _exchange(buffer, sizes, sizes, group, fp8_communication)  # [src, local expert, capacity] rows
    grouped = received.view(ep, local, capacity, -1).transpose(0, 1).reshape(ep * local * capacity, -1)
    plan = DispatchPlan(tokens, top_k, kept, sizes, sizes, None, group, capacity, rows_at, fp8_communication)
    return grouped, counts, plan


def combine_padded(expert_out: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor) -> torch.Tensor:
    """Inverse of `dispatch_padded`, then each token's routing-weighted sum: [T, H]."""
    assert plan.padded_rows is not None
    if plan.group is not None:
        ep = len(plan.send_sizes)
        local = plan.send_sizes[0] // plan.capacity if plan.capacity else 0
        by_source = expert_out.view(local, ep, plan.capacity, -1).transpose(0, 1).reshape(-1, expert_out.shape[-1])
        expert_out = _exchange(by_source, plan.send_sizes, plan.send_sizes, plan.group, plan.fp8_communication)
    return _weighted_sum(expert_out[plan.padded_rows], plan, weights)
