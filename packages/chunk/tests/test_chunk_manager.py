"""ChunkManager: grouping, and memory accounting that equals the sum of resident payloads after every operation."""

from __future__ import annotations

import pytest
import torch

from _chunk_helpers import assert_accounted
from cx_chunk import ChunkConfig, ChunkError, ChunkManager, Residence, TensorState
from cx_mesh.testing import distributed


def _check(manager: ChunkManager) -> None:
    assert_accounted(manager)
    assert manager.peak.device >= manager.usage.device
    assert manager.peak.host >= manager.usage.host


@distributed(world_size=(1, 2))
def test_chunk_manager_accounting_after_every_operation(rank: int, world_size: int) -> None:
    manager = ChunkManager(ChunkConfig(chunk_size=24, separate_above=30))
    params = [torch.randn(n) for n in (10, 10, 10, 40, 3, 7)]
    for index, p in enumerate(params):
        manager.register_tensor(p, name=f"p{index}")
        _check(manager)
    manager.close_all_groups()
    _check(manager)
    chunks = manager.chunks()
    # 10+10 | 10+3+7 | [40 alone] (next-fit; the outlier gets its own chunk and does not close the open one)
    assert [c.tensors for c in chunks][2] == [params[3]]
    assert [len(c.tensors) for c in chunks] == [2, 3, 1]
    assert chunks[2].chunk_size == -(-40 // world_size) * world_size
    manager.create_master_chunks("param")
    _check(manager)
    peak_before = manager.peak
    for chunk in chunks:
        manager.access_chunk(chunk)
        _check(manager)
    assert manager.usage.device == sum(c.nbytes for c in chunks) + sum(
        manager.master_chunk(c).shard_nbytes for c in chunks
    )
    assert manager.peak.device >= peak_before.device
    for chunk in chunks:
        manager.transition(chunk.tensors, TensorState.COMPUTE)
        manager.transition(chunk.tensors, TensorState.HOLD_AFTER_BWD)
        for tensor in chunk.tensors:
            manager.write_grad(tensor, torch.ones_like(tensor))
        manager.transition(chunk.tensors, TensorState.READY_FOR_REDUCE)
        manager.reduce_chunk(chunk)
        _check(manager)
    for chunk in chunks:
        manager.move_chunk(chunk, Residence.HOST)
        _check(manager)
        manager.move_chunk(manager.master_chunk(chunk), Residence.HOST)
        _check(manager)
    assert manager.usage.device == 0
    manager.access_chunk(chunks[0])
    _check(manager)
    assert manager.release_chunk(chunks[0]) is True
    _check(manager)
    grad = manager.grad_chunk(chunks[1], Residence.HOST)
    _check(manager)
    manager.access_chunk(chunks[1])
    for tensor in chunks[1].tensors:
        manager.accumulate_grad(tensor, torch.ones_like(tensor))
        _check(manager)
    assert grad.is_gathered
    exp_avg = manager.create_state_chunk(chunks[0], "exp_avg", residence=Residence.HOST)
    _check(manager)
    assert manager.state_chunk(chunks[0], "exp_avg") is exp_avg
    assert exp_avg.memory_usage().host == exp_avg.shard_nbytes == chunks[0].shard_size * 4
    manager.move_chunk(exp_avg, Residence.DEVICE)
    _check(manager)
    with pytest.raises(ChunkError, match="already has a state chunk named 'exp_avg'"):
        manager.create_state_chunk(chunks[0], "exp_avg")
    assert_accounted(manager)
    manager.reset_peak()
    assert manager.peak == manager.usage


@distributed(world_size=1)
def test_chunk_manager_rejects_bad_registration(rank: int, world_size: int) -> None:
    manager = ChunkManager(ChunkConfig(chunk_size=8))
    a = torch.zeros(3)
    manager.register_tensor(a)
    with pytest.raises(ValueError, match="already registered"):
        manager.register_tensor(a)
    with pytest.raises(ValueError, match=r"holds torch\.float32"):
        manager.register_tensor(torch.zeros(2, dtype=torch.bfloat16))
    manager.register_tensor(torch.zeros(2, dtype=torch.bfloat16), "half")
    with pytest.raises(ChunkError, match="close chunk group 'param' first"):
        manager.create_master_chunks("param")
    manager.close_all_groups()
    with pytest.raises(ChunkError, match="closed"):
        manager.register_tensor(torch.zeros(1))
    with pytest.raises(KeyError, match="not registered"):
        manager.get_chunk(torch.zeros(1))
    with pytest.raises(KeyError, match="no master chunk"):
        manager.master_chunk(manager.get_chunk(a))


@distributed(world_size=2)
def test_chunk_manager_rejects_size_not_multiple_of_group(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="not a multiple of the group size 2"):
        ChunkManager(ChunkConfig(chunk_size=9))


@distributed(world_size=2)
def test_chunk_manager_accounting_after_prefetch_completed_implicitly(rank: int, world_size: int) -> None:
    # a prefetched (in-flight) gather that manager operations complete on the way (master and gradient chunk
    # creation, write_grad, accumulate_grad) must still be accounted: completing it frees the own slice
    manager = ChunkManager(ChunkConfig(chunk_size=16))
    params = [torch.randn(8) for _ in range(4)]
    for index, p in enumerate(params):
        manager.register_tensor(p, name=f"p{index}")
    manager.close_all_groups()
    first, second = manager.chunks()
    manager.prefetch_chunk(first)
    manager.create_master_chunks("param")
    _check(manager)
    manager.release_chunk(first)
    manager.prefetch_chunk(first)
    manager.transition(first.tensors, TensorState.COMPUTE)
    manager.transition(first.tensors, TensorState.HOLD_AFTER_BWD)
    manager.write_grad(first.tensors[0], torch.ones(8))
    _check(manager)
    manager.prefetch_chunk(second)
    manager.accumulate_grad(second.tensors[0], torch.ones(8))
    _check(manager)
    assert not first.gather_pending
    assert not second.gather_pending
