"""Whole tensors between their owner rank and the ranks that hold flat pieces of them: one `gather` or `scatter`
per owner, shared by the engines that step whole parameters (`_whole_step` for LowLevelZero's equal padded slices,
`gemini._whole` for chunk shards, where a parameter's elements lie in any number of ranks' shards).

Each tensor is described by its spans: for every rank of the group, the flat element range [begin, end) that rank
holds (empty ranges allowed; together they cover the tensor, possibly with trailing padding). A rank's pieces of
the tensors one owner owns travel as one buffer, zero-padded to the widest rank's total (`gather` and `scatter`
move equal sizes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cx_mesh import ProcessGroup, communication_device, named_collective, record_collective

__all__ = ["Spans", "gather_to_owner", "global_rank", "scatter_from_owner"]

Spans = Sequence[tuple[int, int]]  # per group rank: the flat range [begin, end) of the tensor that rank holds


def global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _width(spans: Sequence[Spans], rank: int) -> int:
    return sum(s[rank][1] - s[rank][0] for s in spans)


def _padded(pieces: Sequence[torch.Tensor], width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    flat = [t.detach().reshape(-1).to(dtype) for t in pieces]
    buffer = torch.cat(flat) if flat else torch.zeros(0, dtype=dtype)
    buffer = buffer.to(device)
    return F.pad(buffer, (0, width - buffer.numel())) if buffer.numel() < width else buffer


def gather_to_owner(
    group: ProcessGroup | None,
    owner: int,
    rank: int,
    spans: Sequence[Spans],
    local: Sequence[torch.Tensor],
    dtype: torch.dtype,
) -> list[torch.Tensor] | None:
    """On `owner` (group rank): each tensor whole and flat (its spans concatenated, in `dtype`, on the group's
    communication device); None elsewhere. `local[i]` is this rank's piece of tensor i (`spans[i][rank]` long).
    Collective over `group`."""
    size = len(spans[0])
    device = communication_device(group)
    send = _padded(local, max(_width(spans, r) for r in range(size)), dtype, device)
    received = [torch.empty_like(send) for _ in range(size)] if rank == owner else None
    record_collective("gather", group, send)
    with named_collective("gather", group):
        dist.gather(send, received, dst=global_rank(group, owner), group=group)
    if received is None:
        return None
    offsets = [0] * size
    wholes = []
    for tensor_spans in spans:
        parts = []
        for r, (begin, end) in enumerate(tensor_spans):
            parts.append(received[r][offsets[r] : offsets[r] + end - begin])
            offsets[r] += end - begin
        wholes.append(torch.cat(parts))
    return wholes


def scatter_from_owner(
    group: ProcessGroup | None,
    owner: int,
    rank: int,
    spans: Sequence[Spans],
    wholes: Sequence[torch.Tensor] | None,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """This rank's piece of each tensor (`spans[i][rank]` long, in `dtype`, on the communication device), sent by
    `owner` from its flat `wholes` (long enough to cover every span; None elsewhere). Collective over `group`."""
    size = len(spans[0])
    device = communication_device(group)
    width = max(_width(spans, r) for r in range(size))
    received = torch.empty(width, dtype=dtype, device=device)
    pieces = None
    if rank == owner:
        assert wholes is not None
        pieces = [
            _padded(
                [w.reshape(-1)[s[r][0] : s[r][1]] for w, s in zip(wholes, spans, strict=True)], width, dtype, device
            )
            for r in range(size)
        ]
    record_collective("scatter", group, received)
    with named_collective("scatter", group):
        dist.scatter(received, pieces, src=global_rank(group, owner), group=group)
    out, offset = [], 0
    for s in spans:
        out.append(received[offset : offset + s[rank][1] - s[rank][0]])
        offset += s[rank][1] - s[rank][0]
    return out
