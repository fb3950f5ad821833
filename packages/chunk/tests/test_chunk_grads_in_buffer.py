"""Gradients written into a gathered parameter chunk's own buffer (`write_grad_in_buffer` + `reduce_into`) give
exactly what a separate gradient buffer gives, keep the parameter values (copied aside, or cast back from the
master chunk), and need one full-size buffer instead of two; `register_apart` packs tensors without padding."""

from __future__ import annotations

import pytest
import torch

from _chunk_helpers import assert_accounted
from cx_chunk import ChunkConfig, ChunkError, ChunkManager, TensorState
from cx_mesh.testing import distributed

SHAPES = [(6, 5), (7,), (3, 4), (2,)]


def _params(dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]


def _grads(rank: int, micro: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * micro + rank)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _manager(dtype: torch.dtype, world_size: int, *, master: bool) -> tuple[ChunkManager, list[torch.Tensor]]:
    params = _params(dtype)
    manager = ChunkManager(ChunkConfig(chunk_size=64 * world_size))
    for index, p in enumerate(params):
        manager.register_tensor(p, name=f"p{index}")
    manager.close_all_groups()
    if master:
        manager.create_master_chunks("param", torch.float32)
    return manager, params


def _backward(manager: ChunkManager, params: list[torch.Tensor], grads: list[torch.Tensor], in_buffer: bool) -> None:
    """One backward through the chunk: gather, gradients in reverse order (the last one skipped: unused), reduce."""
    chunk = manager.get_chunk(params[0])
    manager.access_chunk(chunk)
    for p in params:
        chunk.transition(p, TensorState.COMPUTE)
    for p, g in list(zip(params, grads, strict=True))[:0:-1]:
        if in_buffer:
            manager.write_grad_in_buffer(p, g.to(p.dtype))
        else:
            manager.accumulate_grad(p, g)
        chunk.transition(p, TensorState.HOLD_AFTER_BWD)
        chunk.transition(p, TensorState.READY_FOR_REDUCE)
    for state in (TensorState.HOLD_AFTER_BWD, TensorState.READY_FOR_REDUCE):
        chunk.transition(params[0], state)  # never got a gradient: counts as zero
    manager.reduce_chunk(chunk)
    manager.release_chunk(chunk)


@distributed(world_size=(2, 4))
@pytest.mark.parametrize(("dtype", "master"), [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_chunk_grads_in_buffer_match_a_separate_gradient_buffer(
    rank: int, world_size: int, dtype: torch.dtype, master: bool
) -> None:
    ours, ours_params = _manager(dtype, world_size, master=master)
    theirs, their_params = _manager(dtype, world_size, master=master)
    for micro in range(2):  # two micro-steps: the reduced slices accumulate in the gradient chunk
        grads = _grads(rank, micro)
        _backward(ours, ours_params, grads, in_buffer=True)
        _backward(theirs, their_params, grads, in_buffer=False)
        assert_accounted(ours)
    chunk, their_chunk = ours.get_chunk(ours_params[0]), theirs.get_chunk(their_params[0])
    assert not chunk.is_gathered
    assert not chunk.grads_in_buffer
    torch.testing.assert_close(ours.grad_chunk(chunk).shard_tensor(), theirs.grad_chunk(their_chunk).shard_tensor())
    # with a master the chunk keeps no own slice (the master holds the values), without one it kept a copy
    assert chunk.has_own_slice is not master
    ours.access_chunk(chunk)  # parameter values kept either way
    for p, original in zip(ours_params, _params(dtype), strict=True):
        torch.testing.assert_close(p, original, rtol=0, atol=0)
    ours.release_chunk(chunk)
    assert all(chunk.tensor_state(p) is TensorState.HOLD for p in ours_params)
    # one full buffer in flight instead of two
    assert ours.peak.device < theirs.peak.device


@distributed(world_size=2)
def test_chunk_grads_in_buffer_state_refuses_what_would_lose_them(rank: int, world_size: int) -> None:
    manager, params = _manager(torch.float32, world_size, master=False)
    chunk = manager.get_chunk(params[0])
    manager.access_chunk(chunk)
    chunk.transition(params[1], TensorState.COMPUTE)
    manager.write_grad_in_buffer(params[1], torch.ones(SHAPES[1]))
    assert chunk.grads_in_buffer
    assert chunk.is_gathered
    assert not chunk.gather()  # still gathered: the other slots keep parameter values
    torch.testing.assert_close(params[0], _params(torch.float32)[0])
    with pytest.raises(ChunkError, match="unreduced gradients"):
        chunk.shard()
    with pytest.raises(ChunkError, match="unreduced gradients"):
        chunk.move(chunk.residence)
    kept = ChunkManager(ChunkConfig(chunk_size=64 * world_size, keep_gathered=True))
    replicated = torch.zeros(3)
    kept.register_tensor(replicated)
    kept.close_all_groups()
    with pytest.raises(ChunkError, match="only in sharded chunks"):
        kept.write_grad_in_buffer(replicated, torch.ones(3))


@distributed(world_size=(1, 2, 4))
def test_chunk_register_apart_packs_tensors_into_chunks_of_their_own(rank: int, world_size: int) -> None:
    manager = ChunkManager(ChunkConfig(chunk_size=100 * world_size, separate_above=30))
    ordinary = torch.randn(10)
    manager.register_tensor(ordinary, name="ordinary")  # an open chunk the apart tensors must not join
    apart = [torch.randn(40), torch.randn(5), torch.randn(250 * world_size), torch.randn(3)]
    values = [t.clone() for t in apart]
    made = manager.register_apart(apart, names=["a", "b", "huge", "c"])
    # largest first, first fit, chunks up to the largest tensor's size: the small ones go together (the outlier
    # rule does not split a set that is apart anyway), not one chunk each; each chunk sized to what it holds
    assert [[s.name for s in c.slots] for c in made] == [["huge"], ["a", "b", "c"]]
    round_up = lambda n: -(-n // world_size) * world_size  # noqa: E731
    assert [c.chunk_size for c in made] == [round_up(sum(s.numel for s in c.slots)) for c in made]
    assert all(c.is_closed for c in made)
    assert manager.get_chunk(ordinary) not in made
    with pytest.raises(ValueError, match="mix dtypes"):
        manager.register_apart([torch.zeros(2, dtype=torch.float64)], "param")
    manager.close_all_groups()
    for tensor, value in zip(apart, values, strict=True):
        chunk = manager.get_chunk(tensor)
        manager.access_chunk(chunk)
        torch.testing.assert_close(tensor, value)
        manager.release_chunk(chunk)
    assert_accounted(manager)
    with pytest.raises(ValueError, match="given twice or is already registered"):
        manager.register_apart([ordinary], "other")
    with pytest.raises(ChunkError, match="closed"):
        manager.register_apart([torch.zeros(2)], "param")


@distributed(world_size=(2, 4))
def test_chunk_async_reduce_into_completes_later_with_the_same_result(rank: int, world_size: int) -> None:
    ours, ours_params = _manager(torch.float32, world_size, master=False)
    theirs, their_params = _manager(torch.float32, world_size, master=False)
    grads = _grads(rank, 0)
    _backward(theirs, their_params, grads, in_buffer=True)
    chunk = ours.get_chunk(ours_params[0])
    ours.access_chunk(chunk)
    for p, g in zip(ours_params, grads, strict=True):
        for state in (TensorState.COMPUTE, TensorState.HOLD_AFTER_BWD):
            chunk.transition(p, state)
        ours.write_grad_in_buffer(p, g)
        chunk.transition(p, TensorState.READY_FOR_REDUCE)
    ours.reduce_chunk(chunk, async_op=True)
    assert chunk.reducing
    assert ours.reducing == [chunk]
    assert_accounted(ours)  # the in-flight output slice is accounted
    with pytest.raises(ChunkError, match="being reduced"):
        chunk.gather()
    with pytest.raises(ChunkError, match="being reduced"):
        ours.write_grad_in_buffer(ours_params[0], grads[0])
    assert ours.finish_reductions() == [chunk]
    assert not ours.reducing
    assert not chunk.is_gathered
    assert_accounted(ours)
    # the synchronous reference left params[0] without a gradient (zero); here all four have one
    expected = theirs.grad_chunk(theirs.get_chunk(their_params[0])).shard_tensor().clone()
    mine = ours.grad_chunk(chunk).shard_tensor()
    first = chunk.slot(ours_params[0])
    lo, hi = max(first.begin, chunk.shard_begin), min(first.end, chunk.shard_end)
    if lo < hi:
        mine = mine.clone()
        mine[lo - chunk.shard_begin : hi - chunk.shard_begin] = 0
    torch.testing.assert_close(mine, expected)
    assert all(chunk.tensor_state(p) is TensorState.HOLD for p in ours_params)


@distributed(world_size=2)
def test_chunk_async_fp8_reduce_into_accounts_the_fp8_exchange_buffers(rank: int, world_size: int) -> None:
    # in flight, an fp8 reduce-scatter holds its packed send and receive messages (one byte per element plus a
    # 4-byte scale per rank each), not the plain gloo collective's received slices in the chunk's dtype
    manager = ChunkManager(ChunkConfig(chunk_size=64 * world_size), fp8_communication=True)
    params = _params(torch.bfloat16)
    for index, p in enumerate(params):
        manager.register_tensor(p, name=f"p{index}")
    manager.close_all_groups()
    manager.create_master_chunks("param", torch.float32)
    chunk = manager.get_chunk(params[0])
    manager.access_chunk(chunk)
    for p, g in zip(params, _grads(rank, 0), strict=True):
        for state in (TensorState.COMPUTE, TensorState.HOLD_AFTER_BWD):
            chunk.transition(p, state)
        manager.write_grad_in_buffer(p, g.to(p.dtype))
        chunk.transition(p, TensorState.READY_FOR_REDUCE)
    assert chunk.reduce_scratch_nbytes == 2 * (chunk.chunk_size + 4 * world_size)
    manager.reduce_chunk(chunk, async_op=True)
    assert_accounted(manager)  # the live count reads the handle's own buffers
    assert manager.finish_reductions() == [chunk]
    assert_accounted(manager)


@distributed(world_size=(1, 2))
def test_chunk_release_frees_the_buffer_that_saved_views_still_see(rank: int, world_size: int) -> None:
    # autograd keeps views of the parameters it saved in forward; releasing the chunk must free the memory anyway,
    # and the gather before backward must refill the very storage those views look at
    manager, params = _manager(torch.float32, world_size, master=False)
    chunk = manager.get_chunk(params[0])
    manager.access_chunk(chunk)
    saved = params[1].data  # what autograd would hold
    values = saved.clone()
    manager.release_chunk(chunk)
    if world_size > 1:
        assert saved.untyped_storage().nbytes() == 0  # freed although still referenced
    assert_accounted(manager)
    manager.access_chunk(chunk)
    torch.testing.assert_close(saved, values)  # the same storage, gathered again
    assert saved.untyped_storage().data_ptr() == params[1].untyped_storage().data_ptr()
    manager.release_chunk(chunk)
