"""Prefetch after warm-up gathers the next chunks before the periods that use them; MemStats and the tracer record
the order and the non-model data; a MemStats recorded before training skips the warm-up."""

from __future__ import annotations

import pytest
import torch

from _chunk_helpers import assert_accounted, layered_manager, layered_params, run_period
from cx_chunk import (
    AutoPlacementPolicy,
    ChunkScheduler,
    MemoryTracer,
    MemStats,
    StaticPlacementPolicy,
    StepTrace,
    TensorState,
)
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
    assert_accounted(manager)


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


class _FakeAccelerator:
    """Device memory figures a test sets by hand: bytes in use now and the peak since the last reset."""

    def __init__(self) -> None:
        self.allocated = 0
        self.peak = 0

    def use(self, nbytes: int) -> None:
        self.allocated = nbytes
        self.peak = max(self.peak, nbytes)

    def memory_allocated(self) -> int:
        return self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak

    def reset_peak_memory_stats(self) -> None:
        self.peak = self.allocated


@distributed(world_size=1)
def test_chunk_tracer_attributes_measured_peak_to_its_own_period(
    rank: int, world_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # measured non-model bytes: the peak reached while period t runs belongs to period t (the peak read when
    # period t+1 starts is period t's, and the last period's is read at end_step); a shift by one would plan each
    # forward period with its predecessor's (smaller) activations
    fake = _FakeAccelerator()
    monkeypatch.setattr("cx_chunk._memstats.get_accelerator", lambda: fake)
    params = layered_params(3, 16, seed=12)
    manager = layered_manager(params, world_size)
    scheduler = ChunkScheduler(manager, StaticPlacementPolicy())
    scheduler.begin_step()
    activations = 0
    for layer, (grows_by, transient) in enumerate([(100, 50), (200, 0), (300, 1000)]):
        scheduler.access(params[layer])
        model = manager.usage.device
        activations += grows_by
        fake.use(model + activations + transient)
        fake.use(model + activations)
        scheduler.manager.transition(params[layer], TensorState.COMPUTE)
        scheduler.manager.transition(params[layer], TensorState.HOLD)
        scheduler.release(params[layer])
        fake.use(manager.usage.device + activations)
    scheduler.end_step()
    assert scheduler.trace is not None
    assert scheduler.trace.non_model_per_period == (150, 300, 1600)


@distributed(world_size=1)
def test_chunk_step_trace_queries_match_a_scan(rank: int, world_size: int) -> None:
    import random

    params = layered_params(6, 16, seed=13)
    manager = layered_manager(params, world_size)
    chunks = manager.chunks()
    generator = random.Random(3)
    periods = tuple(frozenset(generator.sample(chunks, generator.randint(0, 3))) for _ in range(25))
    trace = StepTrace(periods, tuple(range(len(periods))))
    for after in range(-1, len(periods) + 1):
        for chunk in chunks:
            scan = next((p for p in range(after + 1, len(periods)) if chunk in periods[p]), None)
            assert trace.next_use(chunk, after) == scan, (chunk.chunk_id, after)
        firsts: list[int] = []
        for period in range(after + 1, len(periods)):
            firsts += [
                c.chunk_id for c in sorted(periods[period], key=lambda c: c.chunk_id) if c.chunk_id not in firsts
            ]
        assert [c.chunk_id for c in trace.upcoming(after)] == firsts
