"""The fp8 collectives on 2 gloo ranks against the exact sums, and the bytes they hand to torch.distributed.

Error bound per element (the arithmetic, not a measured figure): quantizing x with scale s (amax / fp8 max, at least
2^-126) rounds x / s to the nearest fp8 value, off by at most u * |x| for values in the normal range (u = 2^-4 for
E4M3, 2^-3 for E5M2: `unit_roundoff`) and by at most s * 2^-10 (E4M3) / s * 2^-17 (E5M2), half the subnormal
spacing, below it: e(x) = max(u * |x|, s * tiny * u). A sum of received values adds each term's bound; the float32
dequantize, sum and average round at most 3 times (2^-24 relative each). Writing into a bf16 output rounds once more, by
2^-8 relative.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cx_mesh import all_gather_flat, reduce_scatter_flat
from cx_mesh.fp8 import (
    E4M3,
    E5M2,
    all_gather_flat_fp8,
    all_reduce_fp8,
    all_to_all_single_fp8,
    reduce_scatter_flat_fp8,
    reduce_scatter_scratch_nbytes_fp8,
)
from cx_mesh.testing import count_collective_bytes, distributed, spawn, unit_roundoff

_SCALE = 4  # bytes of one float32 scale


def _quantization_bound(values: torch.Tensor, fp8_dtype: torch.dtype, amax: float) -> torch.Tensor:
    """e(x) above, for values quantized under one scale taken from `amax`."""
    info = torch.finfo(fp8_dtype)
    u = unit_roundoff(fp8_dtype)
    scale = max(amax / info.max, torch.finfo(torch.float32).tiny)  # quantize's MIN_SCALE
    rounding = 2 * unit_roundoff(torch.float32) * values.abs()  # x / s before the cast, and the scale itself
    return torch.maximum(u * values.abs(), torch.full_like(values, scale * info.tiny * u)) + rounding


def _inputs(rank: int, numel: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(numel, generator=generator, dtype=torch.float64) * (1 + rank)).bfloat16().double()


def _assert_within(actual: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, output_u: float) -> None:
    actual = actual.cpu()
    bound = bound + 3 * unit_roundoff(torch.float32) * (exact.abs() + bound)  # float32 dequantize, sum, average
    bound = bound + output_u * (exact.abs() + bound)  # the output dtype's rounding of a value within the bound
    excess = (actual.double() - exact).abs() - bound
    assert excess.max() <= 0, f"off by {excess.max().item():.3g} beyond the bound"


@distributed(world_size=2)
def test_fp8_collectives_match_exact_sums_within_the_quantization_bound_at_half_the_bytes(
    rank: int, world_size: int
) -> None:
    _check_collectives(rank, world_size, torch.device("cpu"))


def _poll(work: dist.Work) -> bool:
    """Whether `work` reports completion within a bounded number of polls (never calling its wait)."""
    for _ in range(1000):
        if work.is_completed():
            return True
        time.sleep(0.01)
    return False


class _PeakNewBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors that ops create under the mode (those on an input's storage, views and
    in-place results, which allocate nothing, excluded), each counted until its Python object is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                nbytes = tensor.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._free, nbytes)
        return out


@distributed(world_size=2)
def test_fp8_async_handles_report_completion_once_the_exchange_is_done(rank: int, world_size: int) -> None:
    """A poller (cx_zero's bucket reducer) must see an async fp8 reduce-scatter, and cx_mesh's plain gloo one, as
    complete once its exchange has arrived, not only after `wait`: True means the output is final and the handle's
    buffers are freed. The all-reduce's second half is a collective, which a poll must not issue: it completes only
    through `wait`. Also the fp8 reduce-scatter's scratch figure against the buffers its handle really holds, and
    the float32 bytes its finish allocates."""
    mine = _inputs(rank, 48).bfloat16()
    expected = torch.empty(24, dtype=torch.float32)
    reduce_scatter_flat_fp8(expected, mine)
    plain_expected = torch.empty(24, dtype=torch.bfloat16)
    reduce_scatter_flat(plain_expected, mine)
    for collective, out, want in (
        (reduce_scatter_flat_fp8, torch.empty(24, dtype=torch.float32), expected),
        (reduce_scatter_flat, torch.empty(24, dtype=torch.bfloat16), plain_expected),
    ):
        work = collective(out, mine, async_op=True)
        assert work is not None
        if collective is reduce_scatter_flat_fp8:  # the packed send and receive messages
            held = sum(t.untyped_storage().nbytes() for t in work._buffers)  # type: ignore[attr-defined]
            assert held == reduce_scatter_scratch_nbytes_fp8(48) == 2 * (48 + 4 * world_size)
        dist.barrier()  # gloo's barrier completes after every collective issued before it
        assert _poll(work), f"{collective.__name__}'s handle never reported completion"
        assert torch.equal(out, want)  # final without wait
        assert getattr(work, "_buffers", ()) == ()  # freed: fp8's messages
        assert getattr(work, "_received", None) is None  # freed: the plain sum's received slices
        assert work.wait()  # still harmless
        assert torch.equal(out, want)
    # finishing dequantizes and sums row by row: two float32 slices of the output's size at a time (the sum and one
    # row), plus the gathered scales; before, the whole (world, numel) block was dequantized into float32 twice
    out = torch.empty(24, dtype=torch.float32)
    work = reduce_scatter_flat_fp8(out, mine, async_op=True)
    assert work is not None
    dist.barrier()
    with _PeakNewBytes() as finishing:
        work.wait()
    assert torch.equal(out, expected)
    assert 0 < finishing.peak <= 2 * 24 * 4 + world_size * 4
    tensor = mine.clone()
    work = all_reduce_fp8(tensor, async_op=True)
    assert work is not None
    dist.barrier()
    assert not work.is_completed()
    work.wait()
    assert work.is_completed()
    with pytest.raises(ValueError, match="do not split over 2 ranks"):
        reduce_scatter_scratch_nbytes_fp8(47)


def _nccl_collectives(rank: int, world_size: int) -> None:
    _check_collectives(rank, world_size, torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for NCCL")
def test_fp8_collectives_on_nccl() -> None:
    spawn(_nccl_collectives, 2, backend="nccl", timeout=120)


def _check_collectives(rank: int, world_size: int, device: torch.device) -> None:
    """All four collectives, blocking and async, uneven all-to-all splits, all-reduce padding, bf16/fp32/fp16
    inputs and a non-finite value; each result within the bound of the exact float64 value, each byte count half of
    the bf16 collective's plus the scales."""
    u_bf16 = unit_roundoff(torch.bfloat16)
    inputs = [_inputs(r, 24) for r in range(world_size)]
    mine = inputs[rank].bfloat16().to(device)

    # all-gather: every rank gets every rank's quantized tensor, its own included; blocking and async
    gathered = torch.empty(24 * world_size, dtype=torch.bfloat16, device=device)
    with count_collective_bytes() as fp8_bytes:
        all_gather_flat_fp8(gathered, mine)
    with count_collective_bytes() as bf16_bytes:
        all_gather_flat(torch.empty_like(gathered), mine)
    assert fp8_bytes.total == bf16_bytes.total // 2 + _SCALE
    exact = torch.cat(inputs)
    bound = torch.cat([_quantization_bound(x, E4M3, x.abs().max().item()) for x in inputs])
    _assert_within(gathered, exact, bound, u_bf16)
    again = torch.empty_like(gathered)
    work = all_gather_flat_fp8(again, mine, async_op=True)
    assert work is not None
    work.wait()
    assert torch.equal(again, gathered)

    # reduce-scatter: one scale per destination slice, float32 sums; SUM and AVG
    output = torch.empty(12, dtype=torch.float32, device=device)
    with count_collective_bytes() as fp8_bytes:
        reduce_scatter_flat_fp8(output, mine)
    with count_collective_bytes() as bf16_bytes:
        reduce_scatter_flat(torch.empty(12, dtype=torch.bfloat16, device=device), mine)
    assert fp8_bytes.total == bf16_bytes.total // 2 + world_size * _SCALE
    slices = [x.view(world_size, 12) for x in inputs]
    exact = torch.stack([x[rank] for x in slices]).sum(0)
    bound = torch.stack([_quantization_bound(x[rank], E5M2, x[rank].abs().max().item()) for x in slices]).sum(0)
    _assert_within(output, exact, bound, 0.0)
    averaged = torch.empty(12, dtype=torch.bfloat16, device=device)
    work = reduce_scatter_flat_fp8(averaged, mine, op=dist.ReduceOp.AVG, async_op=True)
    assert work is not None
    assert work.wait()
    _assert_within(averaged, exact / world_size, bound / world_size, u_bf16)

    # all-reduce, in place, of an odd numel (padded to the group size): fp8 reduce-scatter, then fp8 all-gather of
    # the reduced slice; bytes are half of a bf16 reduce-scatter plus all-gather, plus world_size + 1 scales
    odd = [x[:23] for x in inputs]
    tensor = odd[rank].bfloat16().to(device)
    with count_collective_bytes() as fp8_bytes:
        work = all_reduce_fp8(tensor, async_op=True)
        assert work is not None
        work.wait()
    padded = 24  # 23 rounded up to a multiple of 2
    bf16_reduce_scatter_plus_gather = 2 * padded + 2 * padded // world_size
    assert fp8_bytes.total == bf16_reduce_scatter_plus_gather // 2 + (world_size + 1) * _SCALE
    # per (op, dtype): bytes and calls; both fp8 messages travel as packed uint8, one call each
    (gather_op,) = set(fp8_bytes.by_op) - {"all_to_all_single"}
    assert fp8_bytes.by_dtype == {
        ("all_to_all_single", torch.uint8): padded + world_size * _SCALE,
        (gather_op, torch.uint8): padded // world_size + _SCALE,
    }, fp8_bytes.by_dtype
    assert fp8_bytes.calls == {("all_to_all_single", torch.uint8): 1, (gather_op, torch.uint8): 1}
    exact = torch.stack(odd).sum(0)
    rs_bound = torch.zeros(padded, dtype=torch.float64)
    for x in odd:
        padded_x = torch.nn.functional.pad(x, (0, 1)).view(world_size, -1)
        rs_bound += torch.cat([_quantization_bound(row, E5M2, row.abs().max().item()) for row in padded_x])
    summed = torch.nn.functional.pad(exact, (0, 1)).view(world_size, -1)
    ag_bound = torch.cat(  # the reduced slice (within rs_bound of the exact sum) quantized again
        [
            _quantization_bound(row.abs() + b, E5M2, (row.abs() + b).max().item())
            for row, b in zip(summed, rs_bound.view(world_size, -1), strict=True)
        ]
    )
    _assert_within(tensor, exact, (rs_bound + ag_bound)[:23], u_bf16)

    # all-to-all with uneven splits (an empty chunk included): rank 0 sends 1 and 0 rows, rank 1 sends 2 and 3
    sends = [[1, 0], [2, 3]]
    rows = [torch.stack([_inputs(10 * r + i, 8) for i in range(sum(sends[r]))]) for r in range(world_size)]
    receives = [sends[source][rank] for source in range(world_size)]
    received = torch.empty(sum(receives), 8, dtype=torch.bfloat16, device=device)
    with count_collective_bytes() as fp8_bytes:
        work = all_to_all_single_fp8(received, rows[rank].bfloat16().to(device), receives, sends[rank], async_op=True)
        assert work is not None
        work.wait()
    assert fp8_bytes.total == sum(sends[rank]) * 8 * 2 // 2 + world_size * _SCALE
    expected_parts, bound_parts = [], []
    for source in range(world_size):
        start = sum(sends[source][:rank])
        part = rows[source][start : start + sends[source][rank]]
        expected_parts.append(part)
        amax = part.abs().max().item() if part.numel() else 0.0
        bound_parts.append(_quantization_bound(part, E4M3, amax))
    _assert_within(received, torch.cat(expected_parts), torch.cat(bound_parts), u_bf16)

    # a non-finite value survives compression, so an fp16 overflow check after the collective still sees it
    poisoned = torch.ones(6, dtype=torch.float16, device=device)
    if rank == 1:
        poisoned[2] = float("inf")
    all_reduce_fp8(poisoned)
    assert not torch.isfinite(poisoned).all()

    # count_collective_bytes counts p2p calls too (batch_isend_irecv: its sends and receives) and restores torch's
    original = dist.batch_isend_irecv
    incoming = torch.empty(5, device=device)
    with count_collective_bytes() as p2p:
        peer = 1 - rank
        ops = [dist.P2POp(dist.isend, torch.ones(5, device=device), peer), dist.P2POp(dist.irecv, incoming, peer)]
        for pending in dist.batch_isend_irecv(ops):
            pending.wait()
    assert p2p.by_op == {"batch_isend_irecv": 2 * 5 * 4}
    assert p2p.by_dtype == {("batch_isend_irecv", torch.float32): 2 * 5 * 4}
    assert p2p.calls == {("batch_isend_irecv", torch.float32): 1}
    assert dist.batch_isend_irecv is original
