"""Prefetch after warm-up gathers the next chunks before the periods that use them; MemStats and the tracer record
the order and the non-model data; a MemStats recorded before training skips the warm-up."""

from __future__ import annotations

import pytest
import torch

from _chunk_helpers import layered_manager, layered_params, run_period
from cx_chunk import AutoPlacementPolicy, ChunkScheduler, MemoryTracer, MemStats, StaticPlacementPolicy
from cx_mesh.testing import distributed


@distributed(world_size=(1, 2, 4))
@pytest.mark.parametrize("max_prefetch", [1, 2])
def test_chunk_prefetch_gathers_ahead_after_warmup(rank: int, world_size: int, max_prefetch: int) -> None:
    layers = 5
    params = layered_params(layers, 48, seed=8)
    references = [[p.clone() for p in group] for group in params]
    manager = layered_manager(params, world_size)
    scheduler = ChunkScheduler(manager, StaticPlacementPolicy(), max_prefetch=max_prefetch)
    chunks = manager.chunks()
    order = [*range(layers), *reversed(range(layers))]
    gathers_per_step = []
    for step in range(3):
        before = manager.collective_counts["all_gather"]
        scheduler.begin_step()
        for period, layer in enumerate(order):
            if step > 0:
                # the chunk this period uses was gathered by an earlier period (prefetch), except the first
                assert chunks[layer].is_gathered == (period > 0), (step, period, layer)
            else:
                assert not chunks[layer].is_gathered
            run_period(scheduler, params[layer], expect=references[layer])
            if step > 0:
                ahead = [c.chunk_id for c in chunks if c.is_gathered]
                window = list(dict.fromkeys(order[period + 1 :]))[:max_prefetch]
                # the chunk just used is released unless the very next period uses it again
                reused = period + 1 < len(order) and order[period + 1] == layer
                assert ahead == sorted(c for c in window if c != layer or reused), (step, period, ahead, window)
        scheduler.end_step()
        gathers_per_step.append(manager.collective_counts["all_gather"] - before)
    # prefetch never adds collectives; after warm-up the last layer's chunk stays gathered between its two uses
    # (a group of one needs no collective: its own slice is the whole chunk)
    expected = [len(order), len(order) - 1, len(order) - 1] if world_size > 1 else [0, 0, 0]
    assert gathers_per_step == expected
    assert scheduler.warmed_up
    assert scheduler.prefetch_log
    assert manager.usage == manager.recount()


@distributed(world_size=2)
def test_chunk_prefetch_respects_auto_budget(rank: int, world_size: int) -> None:
    params = layered_params(4, 64, seed=9)
    references = [[p.clone() for p in group] for group in params]
    manager = layered_manager(params, world_size)
    chunk_bytes = manager.chunks()[0].nbytes
    # 4 shards (2 chunks' worth) + the period's gathered chunk (+1/2) + one prefetch in flight (a full buffer
    # while its shard still exists: +1) + releasing the period's chunk (its shard copied out: +1/2) = 4 chunks:
    # exactly one prefetch fits at a time
    policy = AutoPlacementPolicy(0.0, 1.0, capacity_bytes=4 * chunk_bytes)
    scheduler = ChunkScheduler(manager, policy, max_prefetch=3)
    for _ in range(2):
        scheduler.begin_step()
        for layer in range(4):
            run_period(scheduler, params[layer], expect=references[layer])
        scheduler.end_step()
    assert scheduler.prefetch_log == [(0, 1), (1, 2), (2, 3)]
    assert all(r.device_bytes <= r.budget for r in policy.budget_log)
    assert manager.peak.device <= policy.capacity


@distributed(world_size=2)
def test_chunk_memstats_before_training_skips_warmup(rank: int, world_size: int) -> None:
    params = layered_params(3, 32, seed=10)
    manager = layered_manager(params, world_size)
    tracer = MemoryTracer(model_bytes=lambda: manager.usage.device)
    for layer in [0, 1, 2, 1]:
        tracer.record(params[layer], non_model_bytes=100 * (rank + 1) + layer)
    stats = tracer.memstats
    assert [id(p) for p in stats.param_order] == [id(p) for group in params for p in group]
    assert stats.non_model_bytes(3) == 100 * (rank + 1) + 1
    assert stats.non_model_bytes(99) == stats.max_non_model_bytes()
    scheduler = ChunkScheduler(manager, StaticPlacementPolicy(), max_prefetch=1, memstats=stats)
    assert scheduler.warmed_up
    assert scheduler.trace is not None
    # non-model figures are agreed across ranks (MAX), so every rank takes the same decisions
    assert scheduler.trace.non_model_per_period == (200, 201, 202, 201)
    assert scheduler.trace.next_use(manager.chunks()[1], 1) == 3
    scheduler.begin_step()
    run_period(scheduler, params[0])
    assert scheduler.prefetch_log == [(0, 1)]
    scheduler.end_step()


def test_chunk_memstats_and_tracer_validate() -> None:
    stats = MemStats()
    with pytest.raises(ValueError, match="must be >= 0"):
        stats.record_period([], -1)
    record = MemoryTracer(stats, model_bytes=lambda: 0).record([torch.zeros(1)])
    assert record.non_model_bytes >= 0
    assert len(stats) == 1
    stats.clear()
    assert len(stats) == 0
    assert stats.max_non_model_bytes() == 0
