"""`init_device` (ColossalAI's `chunk_init_device`): chunks are built there, then live and compute on the compute
device. On a CPU-only machine both are the CPU, so these tests check the contract (values, accounting, refusal of
other devices); test_chunk_cuda and cx-zero's GPU tests see the move itself."""

from __future__ import annotations

import pytest
import torch

from _chunk_helpers import assert_accounted
from cx_chunk import Chunk, ChunkConfig, ChunkManager, Residence
from cx_mesh.testing import distributed


@distributed(world_size=(1, 2))
@pytest.mark.parametrize("keep_gathered", [False, True])
def test_chunk_init_device_builds_there_then_lives_on_compute_device(
    rank: int, world_size: int, keep_gathered: bool
) -> None:
    cpu = torch.device("cpu")
    manager = ChunkManager(ChunkConfig(chunk_size=16, keep_gathered=keep_gathered), compute_device=cpu, init_device=cpu)
    params = [torch.full((5,), 1.0), torch.full((7,), 2.0)]
    for p in params:
        manager.register_tensor(p)
    manager.close_all_groups()
    (chunk,) = manager.chunks()
    assert chunk.compute_device == cpu
    assert chunk.residence is Residence.DEVICE
    assert_accounted(manager)
    manager.access_chunk(chunk)
    assert [float(p.sum()) for p in params] == [5.0, 14.0]
    assert_accounted(manager)


@distributed(world_size=1)
def test_chunk_init_device_must_be_host_or_compute_device(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match=r"init_device must be the compute device \(cpu\) or the CPU, got meta"):
        Chunk(8, torch.float32, compute_device=torch.device("cpu"), init_device=torch.device("meta"))
