"""Chunk append/close/gather/shard/move round trips keep every tensor bit-identical, across world sizes."""

from __future__ import annotations

import pytest
import torch

from cx_chunk import Chunk, ChunkConfig, ChunkError, ChunkFullError, ChunkManager, Residence, TensorState
from cx_mesh.testing import distributed

SHAPES = [(3, 5), (7,), (1,), (2, 3, 1), (11, 2)]


def _tensors(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator) * 100).to(dtype) for shape in SHAPES]


def _chunk_size(world_size: int, extra: int = 3) -> int:
    total = sum(torch.Size(s).numel() for s in SHAPES) + extra
    return -(-total // world_size) * world_size


def _residence(chunk: Chunk) -> Residence:
    """Read afresh (a plain attribute read would stay narrowed by mypy across the operations that change it)."""
    return chunk.residence


@distributed(world_size=(1, 2, 4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_chunk_gather_shard_round_trip_is_bit_identical(rank: int, world_size: int, dtype: torch.dtype) -> None:
    tensors = _tensors(dtype)
    reference = [t.clone() for t in tensors]
    chunk = Chunk(_chunk_size(world_size), dtype)
    for index, tensor in enumerate(tensors):
        chunk.append(tensor, name=f"p{index}")
    assert all(torch.equal(t, r) for t, r in zip(tensors, reference, strict=True))
    chunk.close()
    assert not chunk.is_gathered
    # released: each tensor keeps its shape over a storage of zero bytes
    assert all(
        t.untyped_storage().nbytes() == 0 and t.shape == r.shape for t, r in zip(tensors, reference, strict=True)
    )
    flat = torch.cat([r.reshape(-1) for r in reference])
    padded = torch.cat([flat, torch.zeros(chunk.chunk_size - flat.numel(), dtype=dtype)])
    assert torch.equal(chunk.shard_tensor(), padded[chunk.shard_begin : chunk.shard_end])
    for _ in range(2):
        assert chunk.gather() is (world_size > 1)  # a group of one needs no collective
        assert chunk.gather() is False  # already gathered
        assert all(torch.equal(t, r) for t, r in zip(tensors, reference, strict=True))
        assert chunk.shard() is True
        assert chunk.move(Residence.HOST) is True
        assert chunk.residence is Residence.HOST
        assert chunk.move(Residence.HOST) is False
    chunk.gather()
    assert chunk.residence is Residence.DEVICE
    assert all(torch.equal(t, r) for t, r in zip(tensors, reference, strict=True))
    assert chunk.shard(to=Residence.HOST) is True  # eviction: the own slice goes straight to the host
    assert _residence(chunk) is Residence.HOST
    assert chunk.memory_usage().device == 0
    assert chunk.memory_usage().host == chunk.shard_nbytes
    chunk.gather()
    assert all(torch.equal(t, r) for t, r in zip(tensors, reference, strict=True))


@distributed(world_size=(2, 4))
def test_chunk_async_gather_completes_on_wait(rank: int, world_size: int) -> None:
    tensors = _tensors(torch.float32, seed=1)
    reference = [t.clone() for t in tensors]
    chunk = Chunk(_chunk_size(world_size), torch.float32)
    for tensor in tensors:
        chunk.append(tensor)
    chunk.close()
    chunk.gather(async_op=True)
    # while pending, both the shard and the full buffer exist
    assert chunk.memory_usage().device == chunk.nbytes + chunk.shard_nbytes or not chunk.gather_pending
    chunk.wait()
    assert chunk.memory_usage().device == chunk.nbytes
    assert all(torch.equal(t, r) for t, r in zip(tensors, reference, strict=True))


@distributed(world_size=(1, 2))
def test_chunk_keep_gathered_is_never_sharded(rank: int, world_size: int) -> None:
    tensors = _tensors(torch.float32, seed=2)
    reference = [t.clone() for t in tensors]
    chunk = Chunk(_chunk_size(world_size), torch.float32, keep_gathered=True)
    for tensor in tensors:
        chunk.append(tensor)
    chunk.close()
    assert chunk.is_gathered
    assert chunk.shard_size == chunk.chunk_size
    assert all(torch.equal(t, r) for t, r in zip(tensors, reference, strict=True))
    with pytest.raises(ChunkError, match="keep_gathered"):
        chunk.shard()
    assert chunk.move(Residence.HOST) is True
    assert chunk.memory_usage().host == chunk.nbytes
    assert chunk.memory_usage().device == 0
    assert all(torch.equal(t, r) for t, r in zip(tensors, reference, strict=True))
    assert chunk.gather() is False
    assert chunk.residence is Residence.DEVICE


@distributed(world_size=(1, 2, 4))
def test_chunk_shard_views_cover_every_element_once(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    tensors = _tensors(torch.float32, seed=3)
    reference = [t.clone() for t in tensors]
    chunk = Chunk(_chunk_size(world_size, extra=5), torch.float32)
    for index, tensor in enumerate(tensors):
        chunk.append(tensor, name=f"p{index}")
    chunk.close()
    views = chunk.shard_views()
    covered = torch.zeros(sum(t.numel() for t in reference), dtype=torch.int64)
    offsets = {f"p{i}": sum(r.numel() for r in reference[:i]) for i in range(len(reference))}
    for view in views:
        index = int(view.name[1:])
        piece = chunk.shard_tensor()[view.shard_begin : view.shard_end]
        assert torch.equal(piece, reference[index].reshape(-1)[view.tensor_begin : view.tensor_end])
        covered[offsets[view.name] + view.tensor_begin : offsets[view.name] + view.tensor_end] += 1
        shard_view = chunk.shard_view(tensors[index])
        assert shard_view is not None
        assert torch.equal(shard_view, piece)
    here = {view.name for view in views}
    for index, tensor in enumerate(tensors):
        if f"p{index}" not in here:
            assert chunk.shard_view(tensor) is None
    dist.all_reduce(covered)
    assert torch.equal(covered, torch.ones_like(covered))


@distributed(world_size=(1, 2))
def test_chunk_paired_master_has_same_layout(rank: int, world_size: int) -> None:
    tensors = _tensors(torch.bfloat16, seed=4)
    reference = [t.clone() for t in tensors]
    chunk = Chunk(_chunk_size(world_size), torch.bfloat16)
    for tensor in tensors:
        chunk.append(tensor)
    chunk.close()
    master = chunk.clone_layout(torch.float32, residence=Residence.HOST)
    assert master.slots == chunk.slots
    assert master.residence is Residence.HOST
    assert torch.equal(master.shard_tensor(), chunk.shard_tensor().float())
    master.shard_tensor().add_(1.0)  # an optimizer step on the fp32 master
    chunk.copy_shard_from(master)
    chunk.gather()
    assert all(torch.equal(t, (r.float() + 1.0).bfloat16()) for t, r in zip(tensors, reference, strict=True))
    other = Chunk(chunk.chunk_size, torch.float32)
    other.append(torch.zeros(3))
    other.close()
    with pytest.raises(ValueError, match="differ in layout"):
        chunk.copy_shard_from(other)


@distributed(world_size=2)
def test_chunk_bad_input_gives_clear_errors(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="not a multiple of the group size 2"):
        Chunk(7, torch.float32)
    chunk = Chunk(4, torch.float32)
    with pytest.raises(ValueError, match=r"holds torch\.float32"):
        chunk.append(torch.zeros(2, dtype=torch.float16))
    a = torch.zeros(3)
    chunk.append(a, name="a")
    with pytest.raises(ValueError, match="already in chunk"):
        chunk.append(a)
    with pytest.raises(ChunkFullError, match="does not fit"):
        chunk.append(torch.zeros(2))
    with pytest.raises(ChunkError, match="close"):
        chunk.gather()
    chunk.close()
    with pytest.raises(ChunkError, match="closed"):
        chunk.append(torch.zeros(1))
    with pytest.raises(ChunkError, match="closed"):
        chunk.close()
    chunk.gather()
    chunk.transition(a, TensorState.COMPUTE)
    with pytest.raises(ChunkError, match=r"in use: a \(COMPUTE\)"):
        chunk.shard()
    with pytest.raises(ChunkError, match="shard it before moving"):
        chunk.move(Residence.HOST)
    with pytest.raises(KeyError, match="not in chunk"):
        chunk.tensor_state(torch.zeros(1))


@distributed(world_size=1, init_process_group=False)
def test_chunk_needs_an_initialised_process_group(rank: int, world_size: int) -> None:
    with pytest.raises(RuntimeError, match=r"cx_chunk\.Chunk needs torch\.distributed to be initialised"):
        Chunk(4, torch.float32)
    with pytest.raises(RuntimeError, match=r"cx_chunk\.ChunkManager needs torch\.distributed"):
        ChunkManager(ChunkConfig(4))


@distributed(world_size=2)
def test_chunk_empty_and_non_contiguous_tensors(rank: int, world_size: int) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    transposed = base.t()  # non-contiguous
    empty = torch.zeros(0, 5)
    scalar = torch.tensor(7.0)
    tensors = [transposed, empty, scalar]
    references = [t.clone() for t in tensors]
    chunk = Chunk(14, torch.float32)
    slots = [chunk.append(t) for t in tensors]
    assert [s.numel for s in slots] == [12, 0, 1]
    chunk.close()
    chunk.gather()
    for tensor, reference in zip(tensors, references, strict=True):
        assert tensor.shape == reference.shape
        assert torch.equal(tensor, reference)
