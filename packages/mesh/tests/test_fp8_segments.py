"""`all_reduce_fp8_segments` on 2 gloo ranks: each segment's result does not depend on where it lies in the buffer
(bit-exact under a permutation of the segments, the property TorchDDPPlugin's fp8 resume needs), it is within the
quantization bound of the exact average, and bad arguments are named.

Bound per element (the arithmetic of test_fp8_collectives.py, two quantizations): each rank's value x_j is quantized
under its (segment, slice) scale, off by at most u * |x_j| (u = 2^-3 for E5M2) in the normal range, or by half the
subnormal spacing times the scale below it; the float32 average of the received values is then quantized once more
under the reduced slice's own scale, off by u * |average| plus the first error. Values here are far inside E5M2's
normal range relative to each block's amax, so the subnormal term does not arise; float32's own roundings (a few
2^-24 relative) are added.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cx_mesh.fp8 import E5M2, all_reduce_fp8_segments
from cx_mesh.testing import distributed, unit_roundoff

_LENGTHS = [7, 1, 64, 5]  # odd lengths: each padded to the group size on its own


def _segments(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    # very different magnitudes per segment: with one scale per bucket slice the small ones would lose their bits
    return [torch.randn(n, generator=generator) * 10.0 ** (2 * i - 3) * (1 + rank) for i, n in enumerate(_LENGTHS)]


def _reduced(segments: list[torch.Tensor], order: list[int]) -> list[torch.Tensor]:
    """The segments laid out in `order` in one buffer, all-reduced (average), read back in their own order."""
    buffer = torch.cat([segments[i] for i in order])
    all_reduce_fp8_segments(buffer, [segments[i].numel() for i in order], op=dist.ReduceOp.AVG, fp8_dtype=E5M2)
    out: dict[int, torch.Tensor] = {}
    start = 0
    for i in order:
        out[i] = buffer[start : start + segments[i].numel()]
        start += segments[i].numel()
    return [out[i] for i in range(len(segments))]


@distributed(world_size=2)
def test_fp8_segments_round_each_segment_on_its_own(rank: int, world_size: int) -> None:
    segments = _segments(rank)
    straight = _reduced(segments, [0, 1, 2, 3])
    shuffled = _reduced(segments, [2, 0, 3, 1])
    for a, b in zip(straight, shuffled, strict=True):
        assert torch.equal(a, b)  # the layout does not enter the rounding
    everyone = [_segments(r) for r in range(world_size)]
    u, f32 = unit_roundoff(E5M2), unit_roundoff(torch.float32)
    for index, result in enumerate(straight):
        values = torch.stack([ranks[index].double() for ranks in everyone])
        exact = values.mean(dim=0)
        first = u * values.abs().mean(dim=0)  # each rank's quantization error, averaged
        bound = first + u * (exact.abs() + first) + 8 * f32 * values.abs().amax(dim=0)
        excess = (result.double() - exact).abs() - bound
        assert excess.max() <= 0, f"segment {index} off by {excess.max().item():.3g} beyond the bound"
    # every replica holds the same values
    gathered = [torch.empty(sum(_LENGTHS)) for _ in range(world_size)]
    dist.all_gather(gathered, torch.cat(straight))
    assert torch.equal(gathered[0], gathered[1])


@distributed(world_size=2)
def test_fp8_segments_name_bad_arguments(rank: int, world_size: int) -> None:
    buffer = torch.zeros(10)
    with pytest.raises(ValueError, match=r"segment lengths sum to 9, the tensor has 10 elements"):
        all_reduce_fp8_segments(buffer, [4, 5])
    with pytest.raises(ValueError, match=r"takes ReduceOp\.SUM or ReduceOp\.AVG"):
        all_reduce_fp8_segments(buffer, [10], op=dist.ReduceOp.MAX)
    with pytest.raises(ValueError, match="must be contiguous"):
        all_reduce_fp8_segments(torch.zeros(4, 5).t(), [20])
    empty = torch.zeros(6)
    all_reduce_fp8_segments(empty, [0, 6, 0])  # empty segments travel as nothing
    assert torch.equal(empty, torch.zeros(6))
