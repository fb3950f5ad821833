"""Several ranks write one checkpoint in parallel (one merged index) and other rank counts read their own slices."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from checkpoint_helpers import assert_same_state, make_model
from cx_checkpoint import (
    CheckpointError,
    CheckpointIndexFile,
    CheckpointReader,
    GeneralCheckpointIO,
    Region,
    TensorSink,
    TensorSource,
    TensorSpec,
    iter_source,
    load_into,
    write_sharded,
)
from cx_mesh import RankMismatchError
from cx_mesh.testing import distributed


def _full() -> dict[str, torch.Tensor]:
    """The reference state: a real model's state dict, so the checkpoint also loads into that model."""
    return {name: tensor.clone() for name, tensor in make_model(0, hidden=24).state_dict().items()}


def _rows(size: int, parts: int, part: int, skew: int) -> tuple[int, int]:
    """Rows [start, stop) of `part` when `size` rows are cut into `parts` pieces, shifted by `skew` (uneven cuts)."""
    cuts = [0] + [min(size, max(0, (size * i) // parts + skew)) for i in range(1, parts)] + [size]
    return cuts[part], cuts[part + 1]


class RowShardedState:
    """Each rank holds rows [start, stop) of every tensor along dim 0 (scalars: rank 0 holds them)."""

    def __init__(self, specs: Mapping[str, TensorSpec], rank: int, world_size: int, skew: int) -> None:
        self.rank, self.world_size, self.skew = rank, world_size, skew
        self.specs = dict(specs)
        self.local: dict[str, torch.Tensor] = {}

    def region(self, name: str) -> Region:
        shape = self.specs[name].shape
        if not shape:
            return ()
        start, stop = _rows(shape[0], self.world_size, self.rank, self.skew)
        return (slice(start, stop),)

    # TensorSource: gather the full tensor; tensor i is written by rank i % world_size
    def tensor_chunks(self, max_bytes: int) -> Iterator[Mapping[str, torch.Tensor]]:
        chunk: dict[str, torch.Tensor] = {}
        size = 0
        for number, name in enumerate(sorted(self.specs)):
            full = self._gather(name)
            if number % self.world_size != self.rank:
                continue
            if chunk and size + full.nbytes > max_bytes:
                yield chunk
                chunk, size = {}, 0
            chunk[name] = full
            size += full.nbytes
        if chunk:
            yield chunk

    def _gather(self, name: str) -> torch.Tensor:
        spec = self.specs[name]
        if not spec.shape:
            scalar = self.local[name].clone() if self.rank == 0 else torch.zeros((), dtype=spec.dtype)
            dist.broadcast(scalar, src=0)
            return scalar
        rows = max(
            _rows(spec.shape[0], self.world_size, r, self.skew)[1]
            - _rows(spec.shape[0], self.world_size, r, self.skew)[0]
            for r in range(self.world_size)
        )
        padded = torch.zeros((rows, *spec.shape[1:]), dtype=spec.dtype)
        padded[: self.local[name].shape[0]] = self.local[name]
        pieces = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(pieces, padded)
        parts = []
        for r, piece in enumerate(pieces):
            start, stop = _rows(spec.shape[0], self.world_size, r, self.skew)
            parts.append(piece[: stop - start])
        return torch.cat(parts)

    # TensorSink: keep only my rows
    def expected_tensors(self) -> Mapping[str, TensorSpec]:
        return self.specs

    def owned_region(self, name: str) -> Region | None:
        return self.region(name)

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        expected_shape = (
            tuple(s.stop - s.start for s in self.region(name)) + self.specs[name].shape[len(self.region(name)) :]
        )
        assert tuple(tensor.shape) == expected_shape, (name, tensor.shape, expected_shape)  # only my part was read
        self.local[name] = tensor.clone()


def _specs() -> dict[str, TensorSpec]:
    return {name: TensorSpec.of(t) for name, t in _full().items()}


def _save_row_sharded(rank: int, world_size: int, path: Path) -> None:
    state = RowShardedState(_specs(), rank, world_size, skew=0)
    for name, full in _full().items():
        state.local[name] = full[state.region(name)].clone()
    assert isinstance(state, TensorSource)
    assert isinstance(state, TensorSink)
    max_bytes = 600
    index = write_sharded(path, iter_source(state, max_bytes), size_per_shard=max_bytes / 2**20, group=dist.group.WORLD)
    assert set(index.weight_map) == set(_full())
    assert index == CheckpointIndexFile.from_file(path / "model.safetensors.index.json")  # same index on every rank


def _load_row_sharded(rank: int, world_size: int, path: Path, skew: int) -> None:
    state = RowShardedState(_specs(), rank, world_size, skew=skew)
    with CheckpointReader.open(path) as reader:
        load_into(reader, state, strict=True)
    for name, full in _full().items():
        assert torch.equal(state.local[name], full[state.region(name)]), name


save_on = distributed(world_size=(2, 3))(_save_row_sharded)
load_on = distributed(world_size=(1, 2, 3))(_load_row_sharded)


@pytest.mark.parametrize("writers", [2, 3])
def test_checkpoint_parallel_write_then_reshard(tmp_path: Path, writers: int) -> None:
    """Written as 2 (or 3) ranks' row slices, read back by 1, 2 and 3 ranks owning differently cut slices."""
    path = tmp_path / "ckpt"
    save_on(world_size=writers, path=path)
    files = sorted(p.name for p in path.iterdir())
    shards = [f for f in files if f != "model.safetensors.index.json"]
    assert len(shards) > writers
    assert all(f.endswith(f"-of-{len(shards):05d}.safetensors") for f in shards)
    load_on(world_size=1, path=path, skew=0)
    load_on(world_size=2, path=path, skew=3)
    load_on(world_size=3, path=path, skew=-2)
    model = make_model(5, hidden=24)  # the parallel checkpoint is also a plain single-process one
    GeneralCheckpointIO().load_model(model, path)
    assert_same_state(_full(), model.state_dict())


def _failing_source(rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    yield f"ok.{rank}", torch.ones(3)
    if rank == 1:
        raise RuntimeError("rank 1 cannot produce its tensors")
    yield f"more.{rank}", torch.ones(3)


@distributed(world_size=2)
def test_checkpoint_parallel_write_failure_is_raised_everywhere(rank: int, world_size: int, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    expected = RuntimeError if rank == 1 else CheckpointError
    with pytest.raises(expected, match="rank 1"):
        write_sharded(path, _failing_source(rank), group=dist.group.WORLD)
    dist.barrier()
    assert not path.exists()
    assert not list(tmp_path.iterdir())  # staging removed


def _gathering_stream(rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A stream that all-reduces before each tensor (as a tensor-parallel gather does); rank 0 repeats a name at the
    second tensor, so its writer fails while rank 1 is still gathering."""
    for number in range(4):
        value = torch.full((2,), float(number))
        dist.all_reduce(value)
        yield ("again" if rank == 0 and number < 2 else f"t{rank}-{number}"), value


@distributed(world_size=2)
def test_checkpoint_parallel_write_failure_mid_collective_stream(rank: int, world_size: int, tmp_path: Path) -> None:
    """The failing writer consumes the rest of its stream, so both ranks make the same collective calls and both
    raise instead of waiting for each other."""
    with pytest.raises((ValueError, CheckpointError), match="'again' was given twice"):
        write_sharded(tmp_path / "ckpt", _gathering_stream(rank), group=dist.group.WORLD)
    dist.barrier()
    assert not list(tmp_path.iterdir())


@distributed(world_size=2)
def test_checkpoint_parallel_duplicate_names_refused(rank: int, world_size: int, tmp_path: Path) -> None:
    with pytest.raises((ValueError, CheckpointError), match="'same' is written twice"):
        write_sharded(tmp_path / "ckpt", [("same", torch.ones(2))], group=dist.group.WORLD)
    dist.barrier()
    assert not list(tmp_path.iterdir())


@distributed(world_size=2)
def test_checkpoint_dtensor_model_is_gathered(rank: int, world_size: int, tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    reference = make_model(0)
    model = make_model(0)
    model.fc1.weight = torch.nn.Parameter(distribute_tensor(model.fc1.weight.detach(), mesh, [Shard(0)]))
    io = GeneralCheckpointIO()
    target = tmp_path / f"rank{rank}.safetensors"
    io.save_model(model, target, use_safetensors=True)
    plain = make_model(3)
    io.load_model(plain, target)
    assert_same_state(reference.state_dict(), plain.state_dict())
    with pytest.raises(NotImplementedError, match=r"'fc1\.weight' is a DTensor and gather_dtensor=False"):
        io.save_model(model, tmp_path / f"x{rank}.safetensors", use_safetensors=True, gather_dtensor=False)
    with pytest.raises(NotImplementedError, match="DTensor"):
        io.load_model(model, target)


@distributed(world_size=2)
def test_checkpoint_parallel_write_arguments_must_agree(rank: int, world_size: int, tmp_path: Path) -> None:
    with pytest.raises(RankMismatchError, match="write_sharded arguments"):
        write_sharded(tmp_path / f"ckpt{rank}", [(f"t{rank}", torch.ones(2))], group=dist.group.WORLD)
    assert not list(tmp_path.iterdir())
