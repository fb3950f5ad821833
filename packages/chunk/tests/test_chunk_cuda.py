"""The same chunk life cycle on CUDA with NCCL (pinned host memory, device buffers); skipped without 2 GPUs."""

from __future__ import annotations

import pytest
import torch

from _chunk_helpers import assert_accounted
from cx_chunk import ChunkConfig, ChunkManager, Residence, TensorState
from cx_mesh.testing import distributed


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@distributed(world_size=2, backend="nccl", fresh=True)
def test_chunk_cuda_round_trip_reduce_and_offload(rank: int, world_size: int) -> None:
    torch.cuda.set_device(rank)
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=generator).cuda() for n in (7, 30, 5)]
    references = [p.clone() for p in params]
    manager = ChunkManager(ChunkConfig(chunk_size=32), pin_memory=True)
    for p in params:
        manager.register_tensor(p)
    manager.close_all_groups()
    for chunk in manager.chunks():
        manager.move_chunk(chunk, Residence.HOST)
        assert chunk.shard_tensor().is_pinned()
        manager.access_chunk(chunk)
        assert chunk.shard_tensor().device.type == "cuda"
    for p, reference in zip(params, references, strict=True):
        assert torch.equal(p, reference)
    grads = [torch.full_like(p, float(rank + 1)) for p in params]
    for chunk in manager.chunks():
        manager.transition(chunk.tensors, TensorState.COMPUTE)
        manager.transition(chunk.tensors, TensorState.HOLD_AFTER_BWD)
        for tensor in chunk.tensors:
            manager.write_grad(tensor, grads[[id(p) for p in params].index(id(tensor))])
        manager.transition(chunk.tensors, TensorState.READY_FOR_REDUCE)
        manager.reduce_chunk(chunk)
        # mean over ranks of (rank + 1) = 1.5 in every used element, zero padding
        full = torch.zeros(chunk.chunk_size)
        full[: chunk.utilized_size] = 1.5
        torch.testing.assert_close(chunk.shard_tensor().cpu(), full[chunk.shard_begin : chunk.shard_end])
    assert_accounted(manager)
