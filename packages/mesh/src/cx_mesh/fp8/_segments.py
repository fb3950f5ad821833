"""An fp8 all-reduce whose rounding belongs to each segment (parameter) of a flat buffer, not to the buffer.

`all_reduce_fp8` scales each destination slice of its whole input, so a value's rounding depends on what else shares
its slice: torch DDP's gradient buckets are laid out at construction and rebuilt in gradient-ready order after the
first iteration, so a run resumed from a checkpoint rounds its first steps' gradients differently from the straight
run (issue 35: TorchDDPPlugin + fp8_communication did not resume bit-exactly). Here each segment is padded to a
multiple of the group size and cut into one slice per rank on its own, each (slice, segment) block carries its own
scale, and the sums run in float32 in rank order: a segment's result depends only on that segment's values on every
rank, wherever it lies in the buffer. Still one all-to-all and one all-gather per call, with one float32 scale per
segment and rank beside the fp8 payload.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cx_mesh._collectives import ProcessGroup, all_gather_flat, all_to_all_single
from cx_mesh.fp8._formats import E5M2, ScalingRecipe, check_fp8_dtype, quantize

__all__ = ["all_reduce_fp8_segments"]


def _spans(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(start, length) of each non-empty segment (an empty one has nothing to send)."""
    starts = itertools.accumulate(lengths, initial=0)
    return [
        (start, length) for start, length in zip(starts, lengths, strict=False) if length
    ]  # accumulate adds the end


def _blocks(flat: torch.Tensor, spans: Sequence[tuple[int, int]], world: int) -> list[torch.Tensor]:
    """Each segment of `flat`, zero-padded to a multiple of `world`, as a (world, slice) view."""
    blocks = []
    for start, length in spans:
        padded = F.pad(flat[start : start + length].float(), (0, -length % world))
        blocks.append(padded.view(world, padded.numel() // world))
    return blocks


def all_reduce_fp8_segments(
    tensor: torch.Tensor,
    lengths: Sequence[int],
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.AVG,
    group: ProcessGroup | None = None,
    fp8_dtype: torch.dtype = E5M2,
) -> None:
    """In place, synchronously: sum (or average) the flat `tensor` over `group` in fp8, the segments of `lengths`
    (in order, covering the tensor) scaled and sliced each on its own (module docstring). A group of one leaves the
    tensor as it is (nothing travels, so nothing is rounded)."""
    check_fp8_dtype(fp8_dtype)
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise ValueError(f"all_reduce_fp8_segments takes ReduceOp.SUM or ReduceOp.AVG, got {op}")
    if not tensor.is_contiguous():
        raise ValueError("all_reduce_fp8_segments: the tensor must be contiguous (written through a flat view)")
    if any(length < 0 for length in lengths) or sum(lengths) != tensor.numel():
        raise ValueError(
            f"all_reduce_fp8_segments: segment lengths sum to {sum(lengths)}, the tensor has {tensor.numel()} elements"
        )
    world = dist.get_world_size(group)
    if world == 1 or tensor.numel() == 0:
        return
    flat = tensor.view(-1)
    spans = _spans(lengths)
    blocks = _blocks(flat, spans, world)
    widths = [block.shape[1] for block in blocks]
    # reduce-scatter leg: row r of every block goes to rank r, each (row, block) with its own scale
    parts = [quantize(block, fp8_dtype, ScalingRecipe.ROWWISE) for block in blocks]
    payload = torch.cat([part.data.view(torch.uint8) for part in parts], dim=1)
    scales = torch.cat([part.scale for part in parts], dim=1)  # (world, segments) float32
    send = torch.cat([payload, scales.view(torch.uint8)], dim=1)
    received = torch.empty_like(send)
    all_to_all_single(received, send, group=group)
    width = sum(widths)
    got = received[:, :width].view(fp8_dtype)
    got_scales = received[:, width:].contiguous().view(torch.float32)
    reduced, column = [], 0
    for index, block_width in enumerate(widths):
        total = got[0, column : column + block_width].float().mul_(got_scales[0, index])
        for row in range(1, world):
            total.add_(got[row, column : column + block_width].float().mul_(got_scales[row, index]))
        reduced.append(total.div_(world) if op == dist.ReduceOp.AVG else total)
        column += block_width
    # all-gather leg: this rank's reduced slice of each segment, each with its own scale
    mine = [quantize(slice_, fp8_dtype) for slice_ in reduced]
    message = torch.cat(
        [*(part.data.view(torch.uint8) for part in mine), torch.stack([p.scale for p in mine]).view(torch.uint8)]
    )
    gathered = torch.empty(world * message.numel(), dtype=torch.uint8, device=message.device)
    all_gather_flat(gathered, message, group=group)
    rows = gathered.view(world, -1)
    values = rows[:, :width].view(fp8_dtype)
    row_scales = rows[:, width:].contiguous().view(torch.float32)  # (world, segments)
    column = 0
    for index, ((start, length), block_width) in enumerate(zip(spans, widths, strict=True)):
        block = values[:, column : column + block_width].float() * row_scales[:, index : index + 1]
        flat[start : start + length].copy_(block.reshape(-1)[:length])
        column += block_width
