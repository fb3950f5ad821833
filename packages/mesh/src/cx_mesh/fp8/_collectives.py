"""Compressed collectives: cx_mesh's flat collectives with an fp8 payload and float32 scales on the wire.

Same contracts as `cx_mesh.all_gather_flat` / `reduce_scatter_flat` / `all_reduce` / `all_to_all_single`. Each
message is one fp8 payload plus its scale (`pack_fp8`): half the bytes of bf16 plus 4 per scale. Results are
dequantized into the output's own dtype; sums are taken in float32 after the exchange (never in fp8). Every rank
of an all-gather receives the same quantized values, its own slice included, so replicas stay identical.

A group of one rank has nothing to send, so nothing is quantized: each collective checks its arguments as usual and
copies exactly (`_alone`), as the plain collective would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cx_mesh._collectives import ProcessGroup, all_gather_flat, all_to_all_single
from cx_mesh.fp8._formats import E4M3, E5M2, ScalingRecipe, check_fp8_dtype, quantize
from cx_mesh.fp8._wire import SCALE_BYTES, Pending, finish, pack_fp8, unpack_fp8, unpack_rows

__all__ = [
    "all_gather_flat_fp8",
    "all_reduce_fp8",
    "all_to_all_single_fp8",
    "reduce_scatter_flat_fp8",
    "reduce_scatter_scratch_nbytes_fp8",
]

_SUMS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


def _flat(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous (it is written in place through a flat view)")
    return tensor.view(-1)


def _check_sum(op: dist.ReduceOp.RedOpType, what: str) -> None:
    if op not in _SUMS:
        raise ValueError(f"{what} takes ReduceOp.SUM or ReduceOp.AVG (fp8 sums in float32), got {op}")


def _alone(output: torch.Tensor, values: torch.Tensor, async_op: bool) -> dist.Work | None:
    """A group of one: copy `values` into `output` exactly (no fp8 round trip: there is no wire to save bytes on);
    returns the finished call's Work (async_op) or None."""
    flat_out = output.view(-1)

    def then() -> None:
        if flat_out.data_ptr() != values.data_ptr():
            flat_out.copy_(values.reshape(-1))

    return finish(Pending(None, then), async_op)


def all_gather_flat_fp8(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    fp8_dtype: torch.dtype = E4M3,
) -> dist.Work | None:
    """All-gather equal-sized tensors into one flat output (rank-major), each travelling as fp8 with one scale."""
    check_fp8_dtype(fp8_dtype)
    world, numel = dist.get_world_size(group), tensor.numel()
    if output.numel() != world * numel:
        raise ValueError(f"all_gather_flat_fp8: output has {output.numel()} elements, expected {world} x {numel}")
    flat_out = _flat(output, "all_gather_flat_fp8's output")
    if world == 1:
        return _alone(flat_out, tensor, async_op)
    send = pack_fp8(tensor, fp8_dtype)
    received = torch.empty(world * send.numel(), dtype=torch.uint8, device=send.device)
    exchange = all_gather_flat(received, send, group=group, async_op=True)

    def then() -> None:
        flat_out.view(world, numel).copy_(unpack_rows(received.view(world, -1), fp8_dtype))

    return finish(Pending(exchange, then, send, received), async_op)


def reduce_scatter_flat_fp8(
    output: torch.Tensor,
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    fp8_dtype: torch.dtype = E5M2,
) -> dist.Work | None:
    """Sum (or average) a flat tensor over `group` and keep this rank's equal-sized slice: each destination slice
    quantized with its own scale, exchanged with one all-to-all, summed in float32."""
    check_fp8_dtype(fp8_dtype)
    _check_sum(op, "reduce_scatter_flat_fp8")
    world, numel = dist.get_world_size(group), output.numel()
    if tensor.numel() != world * numel:
        raise ValueError(f"reduce_scatter_flat_fp8: input has {tensor.numel()} elements, expected {world} x {numel}")
    flat_out = _flat(output, "reduce_scatter_flat_fp8's output")
    if world == 1:  # the sum (and the average) of one rank's tensor is that tensor
        return _alone(flat_out, tensor, async_op)
    quantized = quantize(tensor.reshape(world, numel), fp8_dtype, ScalingRecipe.ROWWISE)
    send = torch.cat([quantized.data.view(torch.uint8), quantized.scale.view(torch.uint8)], dim=1)
    received = torch.empty_like(send)
    exchange = all_to_all_single(received, send, group=group, async_op=True)

    def then() -> None:
        # row by row into one float32 sum, in rank order: two float32 slices at a time, where dequantizing the
        # whole (world, numel) block at once held world of them twice over
        scales = received[:, numel:].contiguous().view(torch.float32)
        total = received[0, :numel].view(fp8_dtype).float().mul_(scales[0])
        for row in range(1, world):
            total.add_(received[row, :numel].view(fp8_dtype).float().mul_(scales[row]))
        flat_out.copy_(total.div_(world) if op == dist.ReduceOp.AVG else total)

    return finish(Pending(exchange, then, send, received), async_op)


def reduce_scatter_scratch_nbytes_fp8(numel: int, group: ProcessGroup | None = None) -> int:
    """Bytes of temporary buffers `reduce_scatter_flat_fp8` holds while a reduction of `numel` elements over `group`
    is in flight (the fp8 counterpart of `cx_mesh.reduce_scatter_scratch_numel`, for memory accounting): the packed
    send and receive messages, each one fp8 byte per element plus one float32 scale per rank. Finishing it briefly
    adds two float32 slices of the output's size (the running sum and one dequantized row). A group of one holds
    none (nothing is quantized or exchanged)."""
    world = dist.get_world_size(group)
    if numel % world:
        raise ValueError(f"reduce_scatter_scratch_nbytes_fp8: {numel} elements do not split over {world} ranks")
    return 0 if world == 1 else 2 * (numel + SCALE_BYTES * world)


def all_reduce_fp8(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    fp8_dtype: torch.dtype = E5M2,
) -> dist.Work | None:
    """In place: an fp8 reduce-scatter (float32 sums), then an fp8 all-gather of the reduced slice; any numel (padded
    internally to a multiple of the group size). Bytes handed over: half of a bf16 reduce-scatter plus all-gather of
    the same tensor, plus one scale per rank for the first and one for the second. With async_op the all-gather is
    issued by `wait`, after the reduce-scatter has arrived."""
    check_fp8_dtype(fp8_dtype)
    _check_sum(op, "all_reduce_fp8")
    flat = _flat(tensor, "all_reduce_fp8's tensor")
    world, numel = dist.get_world_size(group), tensor.numel()
    if world == 1:  # in place: the tensor already holds the sum
        return _alone(flat, flat, async_op)
    padded = F.pad(flat.float(), (0, -numel % world))
    reduced = torch.empty(padded.numel() // world, dtype=torch.float32, device=tensor.device)
    first = reduce_scatter_flat_fp8(reduced, padded, op, group, async_op=True, fp8_dtype=fp8_dtype)

    def then() -> None:
        gathered = torch.empty_like(padded)
        all_gather_flat_fp8(gathered, reduced, group, fp8_dtype=fp8_dtype)
        flat.copy_(gathered[:numel])

    return finish(Pending(first, then, padded, reduced, local=False), async_op)


def _splits(splits: list[int] | None, rows: int, world: int, what: str) -> list[int]:
    if splits is None:
        if rows % world:
            raise ValueError(f"all_to_all_single_fp8: {what} has {rows} rows, not divisible by the group size {world}")
        return [rows // world] * world
    if len(splits) != world or sum(splits) != rows or min(splits) < 0:
        raise ValueError(f"all_to_all_single_fp8: {what} splits {splits} must be {world} sizes summing to {rows}")
    return list(splits)


def all_to_all_single_fp8(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    fp8_dtype: torch.dtype = E4M3,
) -> dist.Work | None:
    """`all_to_all_single` with one fp8 payload and scale per destination chunk; uneven splits allowed (sizes in
    rows of dim 0, as torch's), empty chunks included."""
    check_fp8_dtype(fp8_dtype)
    if tensor.dim() == 0 or output.dim() == 0 or output.shape[1:] != tensor.shape[1:]:
        raise ValueError(
            f"all_to_all_single_fp8: input {tuple(tensor.shape)} and output {tuple(output.shape)} must have the "
            "same shape after dim 0"
        )
    world = dist.get_world_size(group)
    sends = _splits(input_split_sizes, tensor.shape[0], world, "input")
    receives = _splits(output_split_sizes, output.shape[0], world, "output")
    row = tensor[0].numel() if tensor.shape[0] else output[0].numel() if output.shape[0] else 0
    flat_out = _flat(output, "all_to_all_single_fp8's output")
    if world == 1:
        return _alone(flat_out, tensor, async_op)
    chunks = tensor.reshape(tensor.shape[0], row).split(sends)
    send = torch.cat([pack_fp8(chunk, fp8_dtype) for chunk in chunks])
    receive_bytes = [rows * row + SCALE_BYTES for rows in receives]
    received = torch.empty(sum(receive_bytes), dtype=torch.uint8, device=send.device)
    send_bytes = [rows * row + SCALE_BYTES for rows in sends]
    exchange = all_to_all_single(received, send, receive_bytes, send_bytes, group=group, async_op=True)

    def then() -> None:
        values = [unpack_fp8(message, fp8_dtype=fp8_dtype) for message in received.split(receive_bytes)]
        flat_out.copy_(torch.cat(values))

    return finish(Pending(exchange, then, send, received), async_op)
