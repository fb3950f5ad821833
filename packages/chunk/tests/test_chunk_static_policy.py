"""StaticPlacementPolicy: after a step the resident bytes match the documented formula for several fractions."""

from __future__ import annotations

import pytest
import torch

from _chunk_helpers import assert_accounted, layered_params, run_period
from cx_chunk import ChunkConfig, ChunkManager, ChunkScheduler, MemoryUsage, StaticPlacementPolicy
from cx_mesh.testing import distributed

FRACTIONS = [(0.0, 0.0, 0.0), (0.5, 0.0, 0.0), (1.0, 0.0, 0.0), (0.5, 0.5, 0.0), (1.0, 0.5, 0.0), (1.0, 1.0, 0.0),
             (1.0, 1.0, 0.5), (1.0, 1.0, 1.0), (0.0, 1.0, 0.0)]  # fmt: skip


def _greedy(byte_sizes: list[int], fraction: float) -> list[bool]:
    """Independent restatement of the documented selection rule."""
    chosen, taken, target = [], 0, fraction * sum(byte_sizes)
    for nbytes in byte_sizes:
        chosen.append(taken < target)
        taken += nbytes if taken < target else 0
    return chosen


@distributed(world_size=(1, 2))
@pytest.mark.parametrize(("shard", "optim", "param"), FRACTIONS)
def test_chunk_static_policy_resident_bytes_match_formula(
    rank: int, world_size: int, shard: float, optim: float, param: float
) -> None:
    # chunks of different sizes so the fractions cut at non-trivial points
    sizes = [40, 24, 64, 16, 32]
    params = [[torch.randn(n).bfloat16()] for n in sizes]
    manager = ChunkManager(ChunkConfig(chunk_size=8))  # every tensor > 8 elements gets its own chunk
    for group in params:
        manager.register_tensor(group[0])
    manager.close_all_groups()
    manager.create_master_chunks("param")
    for chunk in manager.chunks():  # an optimizer state (fp32, like the master) placed with it
        manager.create_state_chunk(chunk, "exp_avg")
    scheduler = ChunkScheduler(manager, StaticPlacementPolicy(shard, optim, param))
    for _ in range(2):
        scheduler.begin_step()
        for group in params:
            run_period(scheduler, group)
        scheduler.end_step()
    full = [n * 2 for n in sizes]  # bf16 chunk bytes (each chunk is exactly its tensor, sizes divisible by 1, 2)
    param_shard = [b // world_size for b in full]
    master_shard = [n * 4 // world_size for n in sizes]  # fp32; the master and exp_avg each hold one
    kept, offload_optim, offload_param = _greedy(full, 1 - shard), _greedy(full, optim), _greedy(full, param)
    # a released sharded chunk whose master is on the device keeps no own slice (the master holds its values)
    master_holds = [not offload_optim[i] and world_size > 1 for i in range(len(sizes))]
    device = sum(
        (full[i] if kept[i] else (0 if offload_param[i] or master_holds[i] else param_shard[i]))
        + (0 if offload_optim[i] else 2 * master_shard[i])
        for i in range(len(sizes))
    )
    host = sum(
        (param_shard[i] if offload_param[i] else 0) + (2 * master_shard[i] if offload_optim[i] else 0)
        for i in range(len(sizes))
    )
    assert manager.usage == MemoryUsage(device, host)
    assert_accounted(manager)


@distributed(world_size=1)
def test_chunk_static_policy_values_survive_offload(rank: int, world_size: int) -> None:
    params = layered_params(3, 20, seed=5)
    references = [[p.clone() for p in group] for group in params]
    manager = ChunkManager(ChunkConfig(chunk_size=20))
    for group in params:
        for p in group:
            manager.register_tensor(p)
    manager.close_all_groups()
    scheduler = ChunkScheduler(manager, StaticPlacementPolicy(1.0, 1.0, 1.0))
    assert manager.usage.device == 0
    scheduler.begin_step()
    for group, reference in zip(params, references, strict=True):
        scheduler.access(group)
        assert all(torch.equal(p, r) for p, r in zip(group, reference, strict=True))
        scheduler.release(group)
    scheduler.end_step()
    assert manager.usage.device == 0


def test_chunk_static_policy_rejects_bad_fractions() -> None:
    with pytest.raises(ValueError, match=r"shard_param_frac must be in \[0, 1\], got 1.5"):
        StaticPlacementPolicy(1.5)
    with pytest.raises(ValueError, match=r"offload_param_frac > 0 is only supported with shard_param_frac=1\.0"):
        StaticPlacementPolicy(0.5, 1.0, 0.5)
    with pytest.raises(ValueError, match=r"offload_optim_frac=1\.0"):
        StaticPlacementPolicy(1.0, 0.5, 0.5)
