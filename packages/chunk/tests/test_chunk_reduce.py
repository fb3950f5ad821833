"""Gradient reduction: reduce-scatter equals the mean of per-rank gradients; keep_gathered all-reduces; an extra
data-parallel group averages once more; gradient chunks accumulate reduced slices across micro-steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _chunk_helpers import assert_accounted
from cx_chunk import Chunk, ChunkConfig, ChunkError, ChunkManager, TensorState
from cx_mesh import ProcessGroupMesh
from cx_mesh.testing import PerTestCache, distributed

SHAPES = [(5, 3), (9,), (4, 4), (1,)]
TOLERANCE = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (2e-2, 2e-2), torch.float64: (1e-12, 1e-12)}


def _grads(rank: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _mean_grads(ranks: list[int], seed: int = 0) -> torch.Tensor:
    """float64 reference: the mean over `ranks` of each rank's flattened gradients."""
    stacked = torch.stack([torch.cat([g.reshape(-1) for g in _grads(r, seed)]) for r in ranks]).double()
    return stacked.mean(dim=0)


def _padded(flat: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([flat, torch.zeros(size - flat.numel(), dtype=flat.dtype)])


def _filled_chunk(dtype: torch.dtype, world_size: int, *, keep_gathered: bool = False, **kwargs: object) -> Chunk:
    params = [torch.zeros(shape, dtype=dtype) for shape in SHAPES]
    total = sum(p.numel() for p in params) + 1
    chunk = Chunk(-(-total // world_size) * world_size, dtype, keep_gathered=keep_gathered, **kwargs)  # type: ignore[arg-type]
    for p in params:
        chunk.append(p)
    chunk.close()
    return chunk


def _write_grads(chunk: Chunk, rank: int, dtype: torch.dtype, seed: int = 0) -> None:
    chunk.gather()
    for tensor, grad in zip(chunk.tensors, _grads(rank, seed), strict=True):
        for state in (TensorState.COMPUTE, TensorState.HOLD_AFTER_BWD):
            chunk.transition(tensor, state)
        chunk.write(tensor, grad.to(dtype))
        chunk.transition(tensor, TensorState.READY_FOR_REDUCE)
    assert chunk.can_reduce


@distributed(world_size=(1, 2, 4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_chunk_reduce_scatter_is_mean_of_rank_grads(rank: int, world_size: int, dtype: torch.dtype) -> None:
    chunk = _filled_chunk(dtype, world_size)
    _write_grads(chunk, rank, dtype)
    chunk.reduce()
    assert not chunk.is_gathered
    assert all(chunk.tensor_state(t) is TensorState.HOLD for t in chunk.tensors)
    expected = _padded(_mean_grads(list(range(world_size))), chunk.chunk_size)[chunk.shard_begin : chunk.shard_end]
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(chunk.shard_tensor().double(), expected, rtol=rtol, atol=atol)


@distributed(world_size=(1, 2, 4))
def test_chunk_keep_gathered_reduce_all_reduces(rank: int, world_size: int) -> None:
    chunk = _filled_chunk(torch.float32, world_size, keep_gathered=True)
    _write_grads(chunk, rank, torch.float32)
    chunk.reduce()
    assert chunk.is_gathered
    expected = _padded(_mean_grads(list(range(world_size))), chunk.chunk_size)
    torch.testing.assert_close(chunk.shard_tensor().double(), expected, rtol=1e-6, atol=1e-6)
    offset = 0
    for tensor in chunk.tensors:  # the tensors point at the reduced buffer
        torch.testing.assert_close(tensor.reshape(-1).double(), expected[offset : offset + tensor.numel()])
        offset += tensor.numel()


_MESHES: PerTestCache[int, ProcessGroupMesh] = PerTestCache()


@distributed(world_size=4)
@pytest.mark.parametrize("keep_gathered", [False, True])
def test_chunk_extra_dp_group_reduces_twice(rank: int, world_size: int, keep_gathered: bool) -> None:
    mesh = _MESHES.setdefault(world_size, ProcessGroupMesh(2, 2))  # groups stay alive in the pool: make them once
    intra = mesh.get_group_along_axis(1)  # {0,1}, {2,3}: the chunk's sharding group
    extra = mesh.get_group_along_axis(0)  # {0,2}, {1,3}: replicas of the same shard
    chunk = _filled_chunk(torch.float32, 2, keep_gathered=keep_gathered, group=intra, extra_dp_group=extra)
    _write_grads(chunk, rank, torch.float32)
    chunk.reduce()
    expected = _padded(_mean_grads(list(range(world_size))), chunk.chunk_size)[chunk.shard_begin : chunk.shard_end]
    torch.testing.assert_close(chunk.shard_tensor().double(), expected, rtol=1e-6, atol=1e-6)


@distributed(world_size=(1, 2))
def test_chunk_grad_chunk_accumulates_micro_steps(rank: int, world_size: int) -> None:
    params = [torch.zeros(shape) for shape in SHAPES]
    total = sum(p.numel() for p in params)
    manager = ChunkManager(ChunkConfig(-(-total // world_size) * world_size))
    for p in params:
        manager.register_tensor(p)
    manager.close_all_groups()
    (chunk,) = manager.chunks()
    grad_chunk = manager.grad_chunk(chunk)
    assert grad_chunk.slots == chunk.slots
    assert not grad_chunk.is_gathered
    for micro_step in range(3):
        manager.access_chunk(chunk)
        for p, grad in zip(params, _grads(rank, micro_step), strict=True):
            manager.transition([p], TensorState.COMPUTE)
            manager.transition([p], TensorState.HOLD_AFTER_BWD)
            manager.accumulate_grad(p, grad)
            manager.transition([p], TensorState.READY_FOR_REDUCE)
        assert torch.equal(params[0], torch.zeros(SHAPES[0]))  # parameters untouched by accumulation
        manager.reduce_chunk(chunk)
        manager.release_chunk(chunk)
        assert_accounted(manager)
    expected = sum(_mean_grads(list(range(world_size)), s) for s in range(3))
    assert isinstance(expected, torch.Tensor)
    own = _padded(expected, chunk.chunk_size)[chunk.shard_begin : chunk.shard_end]
    torch.testing.assert_close(grad_chunk.shard_tensor().double(), own, rtol=1e-5, atol=1e-5)
    manager.zero_grad_chunks(set_to_none=False)
    assert torch.count_nonzero(grad_chunk.shard_tensor()) == 0
    manager.zero_grad_chunks()  # set to none: the slice is freed and accounted as such
    assert not grad_chunk.has_own_slice
    assert grad_chunk.memory_usage().device == 0
    assert_accounted(manager)
    with pytest.raises(ChunkError, match=r"not ready for reduce: tensor0 \(HOLD\)"):
        manager.reduce_chunk(chunk)
    manager.transition(params, TensorState.COMPUTE)
    manager.transition(params, TensorState.HOLD_AFTER_BWD)
    manager.transition(params, TensorState.READY_FOR_REDUCE)
    with pytest.raises(ChunkError, match="no gradient was accumulated"):
        manager.reduce_chunk(chunk)
    dist.barrier()
