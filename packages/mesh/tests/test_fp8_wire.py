"""cx_mesh.fp8's public wire format (`pack_fp8` / `unpack_fp8` / `packed_fp8_nbytes`) and the fp8 collectives on a
group of one rank, which copy exactly instead of quantizing (there is no wire to save bytes on)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cx_mesh.fp8 import (
    E4M3,
    E5M2,
    all_gather_flat_fp8,
    all_reduce_fp8,
    all_to_all_single_fp8,
    pack_fp8,
    packed_fp8_nbytes,
    quantize,
    reduce_scatter_flat_fp8,
    reduce_scatter_scratch_nbytes_fp8,
    unpack_fp8,
)
from cx_mesh.testing import count_collective_bytes, distributed


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_pack_fp8_is_the_payload_then_the_scale_and_unpacks_to_the_dequantized_values(fp8_dtype: torch.dtype) -> None:
    tensor = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).bfloat16()
    message = pack_fp8(tensor, fp8_dtype)
    quantized = quantize(tensor, fp8_dtype)
    assert message.dtype == torch.uint8
    assert message.shape == (packed_fp8_nbytes(15),) == (15 + 4,)
    assert torch.equal(message[:15], quantized.data.reshape(-1).view(torch.uint8))
    assert torch.equal(message[15:].clone().view(torch.float32), quantized.scale.reshape(1))
    values = unpack_fp8(message, (3, 5), torch.bfloat16, fp8_dtype)
    assert values.dtype == torch.bfloat16
    assert torch.equal(values, quantized.dequantize(torch.bfloat16))
    assert torch.equal(unpack_fp8(message, fp8_dtype=fp8_dtype), quantized.dequantize().reshape(-1))  # flat, float32
    # a message cut at an odd offset (its scale's bytes not 4-aligned) reads the same
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), message])[1:]
    assert torch.equal(unpack_fp8(shifted, (3, 5), fp8_dtype=fp8_dtype), quantized.dequantize())


def test_unpack_fp8_refuses_what_pack_fp8_did_not_write() -> None:
    message = pack_fp8(torch.ones(4))
    with pytest.raises(ValueError, match="does not fill shape"):
        unpack_fp8(message, (5,))
    with pytest.raises(ValueError, match="1-D uint8 message"):
        unpack_fp8(message.float())
    with pytest.raises(ValueError, match="1-D uint8 message"):
        unpack_fp8(message[:3])
    with pytest.raises(ValueError, match="fp8 dtype"):
        unpack_fp8(message, fp8_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="packed_fp8_nbytes"):
        packed_fp8_nbytes(-1)


@distributed(world_size=1)
def test_fp8_collectives_on_one_rank_copy_exactly_and_send_nothing(rank: int, world_size: int) -> None:
    # float32 values that no fp8 format holds: any quantize round trip would change them
    tensor = torch.randn(24, generator=torch.Generator().manual_seed(1)) * 1e-3 + 1.0
    assert not torch.equal(quantize(tensor, E4M3).dequantize(), tensor)
    with count_collective_bytes() as counted:
        gathered = torch.empty(24)
        assert all_gather_flat_fp8(gathered, tensor) is None
        summed = torch.empty(24)
        reduce_scatter_flat_fp8(summed, tensor)
        averaged = torch.empty(24)
        reduce_scatter_flat_fp8(averaged, tensor, dist.ReduceOp.AVG)
        reduced = tensor.clone()
        all_reduce_fp8(reduced)
        exchanged = torch.empty(6, 4)
        all_to_all_single_fp8(exchanged, tensor.view(6, 4), [6], [6])
        pending = torch.empty(24, dtype=torch.bfloat16)
        work = all_gather_flat_fp8(pending, tensor, async_op=True)
        assert work is not None
        assert work.is_completed()
        assert work.wait()
    for result in (gathered, summed, averaged, reduced, exchanged.view(-1)):
        assert torch.equal(result, tensor)
    assert torch.equal(pending, tensor.bfloat16())  # the output's own dtype, rounded once
    assert counted.total == 0, counted.by_op
    assert reduce_scatter_scratch_nbytes_fp8(24) == 0
    # arguments are still checked
    with pytest.raises(ValueError, match="expected 1 x 24"):
        all_gather_flat_fp8(torch.empty(25), tensor)
    with pytest.raises(ValueError, match=r"ReduceOp\.SUM or ReduceOp\.AVG"):
        all_reduce_fp8(tensor.clone(), dist.ReduceOp.MAX)
