"""The multi-process harness reports every kind of failure by rank, in bounded time, leaving no process behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cx_mesh.testing import DistributedTestFailure, PerTestCache, distributed, run_distributed, spawn


def _sum_ranks(rank: int, world_size: int, out: str) -> None:
    tensor = torch.tensor([float(rank)])
    dist.all_reduce(tensor)
    Path(out, f"rank{rank}").write_text(f"{tensor.item()} {os.getpid()}")


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("planted failure on rank one")


def _hang_on_rank_one(rank: int, world_size: int, out: str) -> None:
    Path(out, f"pid{rank}").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(600)


def _exit_early_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _no_group(rank: int, world_size: int) -> None:
    assert not dist.is_initialized()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_harness_spawn_runs_every_rank(tmp_path: Path) -> None:
    spawn(_sum_ranks, 4, str(tmp_path))
    for rank in range(4):
        total, _ = (tmp_path / f"rank{rank}").read_text().split()
        assert float(total) == 6.0


def test_harness_reports_the_rank_that_raised() -> None:
    with pytest.raises(DistributedTestFailure) as caught:
        spawn(_raise_on_rank_one, 2, timeout=30)
    message = str(caught.value)
    assert "rank 1 raised" in message
    assert "planted failure on rank one" in message


def test_harness_reports_a_hang_in_bounded_time_and_kills_it(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as caught:
        spawn(_hang_on_rank_one, 2, str(tmp_path), timeout=8)
    assert time.monotonic() - start < 20
    assert "rank(s) [1] did not finish" in str(caught.value)
    pid = int((tmp_path / "pid1").read_text())
    assert not _alive(pid)


def test_harness_reports_an_early_exit() -> None:
    with pytest.raises(DistributedTestFailure) as caught:
        spawn(_exit_early_on_rank_one, 2, timeout=30)
    assert "rank 1 exited with code 3 before reporting a result" in str(caught.value)


def test_harness_rejects_local_functions() -> None:
    def local(rank: int, world_size: int) -> None:
        pass

    with pytest.raises(TypeError, match="module level"):
        spawn(local, 2)


def test_harness_without_process_group() -> None:
    spawn(_no_group, 2, init_process_group=False)


@distributed(world_size=(1, 2, 4))
@pytest.mark.parametrize("value", [1.0, 2.5])
def test_harness_decorator_parametrises(rank: int, world_size: int, value: float) -> None:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor)
    assert tensor.item() == value * world_size
    assert dist.get_world_size() == world_size


@distributed(world_size=2)
def test_harness_decorator_passes_fixtures(rank: int, world_size: int, tmp_path: Path) -> None:
    (tmp_path / f"from{rank}").write_text("x")
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["from0", "from1"]


@distributed(world_size=2, fresh=True)
def test_harness_fresh_processes(rank: int, world_size: int) -> None:
    torch.set_default_dtype(torch.float64)  # process-wide change: fine, these processes are thrown away
    assert dist.get_world_size() == 2


def test_harness_pool_recovers_after_a_failure() -> None:
    with pytest.raises(DistributedTestFailure, match="planted failure"):
        run_distributed(_raise_on_rank_one, 2, timeout=30)
    # a healthy task after the failure runs on a fresh pool
    assert set(run_distributed(_exit_early_ok, 2, timeout=30)) == {0, 1}


def _exit_early_ok(rank: int, world_size: int) -> None:
    dist.barrier()


def _skip_everywhere(rank: int, world_size: int) -> None:
    pytest.skip("planted skip")


def test_harness_reports_skips_as_skips() -> None:
    outcomes = spawn(_skip_everywhere, 2, timeout=30)
    assert {rank: (o.ok, o.skipped) for rank, o in outcomes.items()} == {
        0: (True, "planted skip"),
        1: (True, "planted skip"),
    }
    decorated = distributed(world_size=2)(_skip_everywhere)
    with pytest.raises(pytest.skip.Exception, match="planted skip"):
        decorated()


def _change_process_state(rank: int, world_size: int) -> None:
    from cx_mesh import get_accelerator

    torch.set_default_dtype(torch.float64)
    get_accelerator().set_memory_capacity(12345)


def _expect_default_process_state(rank: int, world_size: int) -> None:
    from cx_mesh import get_accelerator

    assert torch.get_default_dtype() == torch.float32
    assert get_accelerator().total_memory() != 12345


def test_harness_pool_resets_process_state_between_tests() -> None:
    for function in (_change_process_state, _expect_default_process_state):
        run_distributed(function, 2, timeout=30)


def _create_groups(rank: int, world_size: int) -> None:
    groups = [dist.new_group([0, 1]) for _ in range(5)]
    for group in groups:
        dist.all_reduce(torch.ones(1), group=group)


def _expect_only_the_world_group(rank: int, world_size: int) -> None:
    from cx_mesh.testing._worker import _live_groups

    assert _live_groups() == [dist.group.WORLD], f"{len(_live_groups())} groups alive"
    dist.all_reduce(torch.ones(1), group=dist.new_group([0, 1]))  # creating groups still works


def test_harness_pool_destroys_the_groups_a_test_created() -> None:
    """Idle gloo groups keep native threads polling: a pooled rank destroys each test's groups when it ends."""
    for function in (_create_groups, _expect_only_the_world_group, _expect_only_the_world_group):
        run_distributed(function, 2, timeout=30)


_SHARED: PerTestCache[str, object] = PerTestCache()


def _fill_the_cache(rank: int, world_size: int) -> None:
    _SHARED["group"] = dist.new_group([0, 1])
    assert _SHARED["group"] is _SHARED.get("group")


def _expect_an_empty_cache(rank: int, world_size: int) -> None:
    assert not _SHARED, "a PerTestCache is emptied when the test that filled it ends"


def test_harness_per_test_cache_is_emptied_between_tests() -> None:
    for function in (_fill_the_cache, _expect_an_empty_cache):
        run_distributed(function, 2, timeout=30)


def _group_of_ranks_zero_and_one(rank: int, world_size: int) -> None:
    dist.all_reduce(torch.ones(1), group=dist.new_group([0, 1]))  # only ranks 0 and 1 hold a group afterwards


def _ordered_by_a_world_barrier(rank: int, world_size: int, out: str) -> None:
    if rank == 0:
        time.sleep(0.5)
        Path(out, "written").write_text("yes")
    dist.barrier()
    assert Path(out, "written").exists(), "the barrier let this rank through before rank 0 reached it"


def test_harness_clean_up_keeps_ranks_in_step(tmp_path: Path) -> None:
    """Ranks outside a test's only group hold nothing to destroy; they must still join the clean-up barrier, or the
    next test's first collective pairs with it."""
    run_distributed(_group_of_ranks_zero_and_one, 4, timeout=30)
    run_distributed(_ordered_by_a_world_barrier, 4, timeout=30, out=str(tmp_path))
