"""AutoPlacementPolicy: simulated multi-period runs stay within the budget, evict farthest-next-use first, fall back
to the host instead of failing, and refuse an impossible budget with a clear error."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from _chunk_helpers import assert_accounted, layered_manager, layered_params, run_period
from cx_chunk import (
    AutoPlacementPolicy,
    BudgetError,
    Chunk,
    ChunkConfig,
    ChunkManager,
    ChunkScheduler,
    Residence,
    StaticPlacementPolicy,
    StepTrace,
    TensorState,
    gather_cost,
)
from cx_mesh import get_accelerator
from cx_mesh.testing import distributed


def _forward_backward(layers: int) -> list[int]:
    return [*range(layers), *reversed(range(layers))]


class _PeakAfterEviction(AutoPlacementPolicy):
    """Restarts the manager's peak once a period's evictions are done, so the test sees that period's peak."""

    def prepare(self, manager: ChunkManager, chunks: Sequence[Chunk], period: int, trace: StepTrace | None) -> None:
        super().prepare(manager, chunks, period, trace)
        manager.reset_peak()


@distributed(world_size=(1, 2))
def test_chunk_auto_policy_never_exceeds_budget(rank: int, world_size: int) -> None:
    layers, numel = 4, 64
    params = layered_params(layers, numel, seed=11)
    references = [[p.clone() for p in group] for group in params]
    manager = layered_manager(params, world_size)
    chunk_bytes = manager.chunks()[0].nbytes
    order = _forward_backward(layers)
    non_model = [(i % 3) * chunk_bytes // 2 for i in range(len(order))]  # varies per period
    capacity = 4 * chunk_bytes
    policy = _PeakAfterEviction(warmup_non_model_data_ratio=0.5, steady_cuda_cap_ratio=1.0, capacity_bytes=capacity)
    scheduler = ChunkScheduler(manager, policy)
    for _ in range(3):
        scheduler.begin_step()
        for period, layer in enumerate(order):
            run_period(scheduler, params[layer], non_model[period], expect=references[layer])
            # from the end of eviction through gather, use and release, including the moments inside gathers and
            # releases when old and new storage coexist
            assert manager.peak.device <= policy.budget_log[-1].budget
        scheduler.end_step()
    assert len(policy.budget_log) == 3 * len(order)
    for record in policy.budget_log:
        assert record.device_bytes <= record.budget
        assert not record.fell_back
    steady = policy.budget_log[len(order) :]
    assert [r.budget for r in steady] == [capacity - non_model[p] for p in range(len(order))] * 2
    assert policy.evictions, "the budget is tight enough that the run must evict"
    assert_accounted(manager)


def _belady(periods: list[int], cache: int, resident: list[int]) -> list[tuple[int, int]]:
    """Reference OPT eviction on a chunk-id sequence: (period, evicted) with ties to the larger id."""
    held, out = list(resident), []
    for t, chunk in enumerate(periods):
        if chunk in held:
            continue
        if len(held) >= cache:

            def next_use(c: int, t: int = t) -> int:
                later = [p for p in range(t + 1, len(periods)) if periods[p] == c]
                return later[0] if later else len(periods) + 1

            victim = max(held, key=lambda c: (next_use(c), c))
            held.remove(victim)
            out.append((t, victim))
        held.append(chunk)
    return out


@distributed(world_size=1)
def test_chunk_auto_policy_evicts_farthest_next_use(rank: int, world_size: int) -> None:
    params = layered_params(4, 32, seed=3)
    references = [[p.clone() for p in group] for group in params]
    manager = layered_manager(params, world_size)
    chunk_bytes = manager.chunks()[0].nbytes
    policy = AutoPlacementPolicy(0.0, 1.0, capacity_bytes=2 * chunk_bytes)
    scheduler = ChunkScheduler(manager, policy)
    assert [c.residence.value for c in manager.chunks()] == ["device", "device", "host", "host"]
    sequence = [0, 1, 2, 0, 3, 1]
    scheduler.begin_step()
    for layer in sequence:
        run_period(scheduler, params[layer])
    scheduler.end_step()
    warmup = [(e.period, e.chunk_id) for e in policy.evictions]
    assert warmup == [(2, 0), (3, 1), (4, 2), (5, 0)]  # least recently used during warm-up
    resident = [c.chunk_id for c in manager.chunks() if c.memory_usage().device]
    policy.evictions.clear()
    scheduler.begin_step()
    for layer in sequence:
        run_period(scheduler, params[layer], expect=references[layer])
    scheduler.end_step()
    steady = [(e.period, e.chunk_id) for e in policy.evictions]
    assert steady == _belady(sequence, 2, resident) == [(0, 3), (2, 1), (4, 2), (5, 3)]


@distributed(world_size=(1, 2))
def test_chunk_auto_policy_impossible_budget_is_a_clear_error(rank: int, world_size: int) -> None:
    params = layered_params(2, 64, seed=4)
    manager = layered_manager(params, world_size)
    chunk_bytes = manager.chunks()[0].nbytes
    scheduler = ChunkScheduler(manager, AutoPlacementPolicy(0.5, 0.9, capacity_bytes=chunk_bytes))
    scheduler.begin_step()
    budget, limit = int(chunk_bytes * 0.5), int(chunk_bytes * 0.9)
    # nothing else is on the device that could move: the need is what is there plus the gather's peak
    need = manager.usage.device + gather_cost(manager.chunks()[0])
    assert need > limit
    with pytest.raises(BudgetError, match=rf"needs {need} bytes.*budget is {budget} bytes.*hard limit {limit} bytes"):
        scheduler.access(params[0], non_model_bytes=0)


@distributed(world_size=(1, 2))
def test_chunk_auto_policy_falls_back_where_static_succeeds(rank: int, world_size: int) -> None:
    params = layered_params(3, 64, seed=6)
    references = [[p.clone() for p in group] for group in params]
    chunk_bytes = layered_manager(layered_params(3, 64), world_size).chunks()[0].nbytes
    capacity = 2 * chunk_bytes
    # warm-up records more non-model data than the device has: the steady budget is negative
    for policy in (StaticPlacementPolicy(), AutoPlacementPolicy(0.0, 1.0, capacity_bytes=capacity)):
        manager = layered_manager(params, world_size)
        scheduler = ChunkScheduler(manager, policy)
        for step in range(2):
            scheduler.begin_step()
            for layer in range(3):
                if step and isinstance(policy, AutoPlacementPolicy):
                    with pytest.warns(RuntimeWarning, match="everything movable is on the host"):
                        run_period(scheduler, params[layer], 3 * chunk_bytes, expect=references[layer])
                    assert policy.budget_log[-1].device_bytes == chunk_bytes  # only what the period itself needs
                else:
                    run_period(scheduler, params[layer], 3 * chunk_bytes, expect=references[layer])
            scheduler.end_step()
        if isinstance(policy, AutoPlacementPolicy):
            assert [r.fell_back for r in policy.budget_log] == [False] * 3 + [True] * 3
        # rebuild the tensors' storage for the next policy's manager
        params = [[p.clone() for p in group] for group in references]


@distributed(world_size=1, fresh=True)
def test_chunk_auto_policy_capacity_defaults_to_accelerator(rank: int, world_size: int) -> None:
    get_accelerator().set_memory_capacity(12345)
    assert AutoPlacementPolicy(0.5, 0.8).hard_limit == int(12345 * 0.8)
    assert AutoPlacementPolicy(0.5, 0.8).budget(0, None) == int(12345 * 0.5)
    trace = StepTrace((frozenset(),), (100,))
    assert AutoPlacementPolicy(0.5, 0.8).budget(0, trace) == int(12345 * 0.8) - 100


def test_chunk_auto_policy_rejects_bad_ratios() -> None:
    with pytest.raises(ValueError, match=r"steady_cuda_cap_ratio must be in \[0, 1\], got 1.2"):
        AutoPlacementPolicy(0.5, 1.2)
    with pytest.raises(ValueError, match="capacity_bytes must be positive"):
        AutoPlacementPolicy(capacity_bytes=0)


@distributed(world_size=2)
def test_chunk_auto_policy_random_runs_stay_within_budget(rank: int, world_size: int) -> None:
    import random

    rng = random.Random(1234)  # the same cases on every rank
    completed = evicted = 0
    for _ in range(25):
        layers = rng.randint(3, 6)
        params = layered_params(layers, 32, seed=rng.randint(0, 1000))
        references = [[p.clone() for p in group] for group in params]
        manager = layered_manager(params, world_size)
        chunk_bytes = manager.chunks()[0].nbytes
        periods = [rng.sample(range(layers), rng.randint(1, 2)) for _ in range(rng.randint(4, 10))]
        non_model = [rng.randint(0, chunk_bytes) for _ in periods]
        capacity = rng.randint(2 * chunk_bytes, 6 * chunk_bytes)
        policy = _PeakAfterEviction(rng.choice([0.0, 0.3]), 1.0, capacity_bytes=capacity)
        scheduler = ChunkScheduler(manager, policy, max_prefetch=rng.randint(0, 2))
        error: BudgetError | None = None
        try:
            for _ in range(2):
                scheduler.begin_step()
                for period, layer_ids in enumerate(periods):
                    tensors = [p for i in layer_ids for p in params[i]]
                    expected = [r for i in layer_ids for r in references[i]]
                    run_period(scheduler, tensors, non_model[period], expect=expected)
                    record = policy.budget_log[-1]
                    assert manager.peak.device <= (policy.hard_limit if record.fell_back else record.budget)
                scheduler.end_step()
        except BudgetError as caught:
            error = caught
        if error is None:
            completed += 1
            evicted += bool(policy.evictions)
        else:
            # only when a period's own chunks (at most 2 gathers, a shard each from the host, one release copy:
            # 3.5 chunks) cannot fit under the hard limit
            assert f"hard limit {policy.hard_limit} bytes" in str(error)
            assert policy.hard_limit < 7 * chunk_bytes // 2
    assert completed >= 15
    assert evicted >= 5


@distributed(world_size=2)
def test_chunk_auto_policy_moves_keep_gathered_chunks_whole(rank: int, world_size: int) -> None:
    params = layered_params(4, 32, seed=12)
    references = [[p.clone() for p in group] for group in params]
    manager = ChunkManager(ChunkConfig(chunk_size=32, keep_gathered=True))
    for group in params:
        for p in group:
            manager.register_tensor(p)
    manager.close_all_groups()
    chunk_bytes = manager.chunks()[0].nbytes
    policy = _PeakAfterEviction(0.0, 1.0, capacity_bytes=2 * chunk_bytes)
    scheduler = ChunkScheduler(manager, policy)
    assert manager.usage.device == 2 * chunk_bytes  # setup moved the last two replicated chunks to the host
    for _ in range(2):
        scheduler.begin_step()
        for layer in [0, 1, 2, 3, 2, 1, 0]:
            run_period(scheduler, params[layer], expect=references[layer])
            assert manager.peak.device <= policy.budget_log[-1].budget
        scheduler.end_step()
    assert len(policy.evictions) >= 4
    assert all(chunk.is_gathered for chunk in manager.chunks())  # replicated chunks are moved, never sharded


@distributed(world_size=(1, 2))
def test_chunk_auto_policy_keeps_in_use_replicated_chunk_on_device(rank: int, world_size: int) -> None:
    # a keep_gathered chunk one of whose tensors is still in COMPUTE (an enclosing operation) must stay in use after
    # an inner operation releases another of its tensors, so a later period cannot evict it to the host under the
    # running operation
    params = layered_params(2, 8 * world_size, seed=14)
    manager = ChunkManager(ChunkConfig(chunk_size=8 * world_size, keep_gathered=True))
    for layer, group in enumerate(params):
        for index, p in enumerate(group):
            manager.register_tensor(p, name=f"layer{layer}.p{index}")
    manager.close_all_groups()
    outer, other = manager.chunks()
    policy = AutoPlacementPolicy(0.5, 1.0, capacity_bytes=2 * outer.nbytes)  # warm-up budget: one chunk
    scheduler = ChunkScheduler(manager, policy)
    assert other.residence is Residence.HOST  # setup moved the last chunk out to meet the warm-up budget
    scheduler.begin_step()
    enclosing, inner = params[0]
    scheduler.access([enclosing], non_model_bytes=0)
    manager.transition([enclosing], TensorState.COMPUTE)
    run_period(scheduler, [inner])  # inner operation on the same chunk: access, compute, release
    assert outer in manager.accessed
    with pytest.warns(RuntimeWarning, match="everything movable is on the host"):
        scheduler.access(params[1], non_model_bytes=0)
    assert outer.residence is Residence.DEVICE
    assert [e.chunk_id for e in policy.evictions] == []
    manager.transition([enclosing], TensorState.HOLD)
    scheduler.release([enclosing])
    assert outer not in manager.accessed
