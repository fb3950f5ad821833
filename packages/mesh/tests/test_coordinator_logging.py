"""DistCoordinator patterns, the rank-aware logger and the accelerator's CPU facts."""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cx_mesh import (
    CpuAccelerator,
    DistCoordinator,
    disable_existing_loggers,
    get_accelerator,
    get_current_device,
    get_dist_logger,
)
from cx_mesh.testing import distributed


@distributed(world_size=2)
def test_coordinator_master_and_decorator(rank: int, world_size: int) -> None:
    coordinator = DistCoordinator()
    assert (coordinator.rank, coordinator.world_size) == (rank, world_size)
    assert coordinator.is_master() == (rank == 0)
    assert coordinator.is_last_process() == (rank == 1)

    @coordinator.on_master_only()
    def answer() -> int:
        return 42

    assert answer() == (42 if rank == 0 else None)


@distributed(world_size=2)
def test_coordinator_priority_execution_orders_ranks(rank: int, world_size: int, tmp_path: Path) -> None:
    marker = tmp_path / "written-by-executor"
    coordinator = DistCoordinator()
    with coordinator.priority_execution() as is_executor:
        if is_executor:
            marker.write_text("done")
        else:
            assert marker.read_text() == "done"  # the executor has finished before anyone else enters
    coordinator.block_all()


@distributed(world_size=2)
def test_coordinator_print_on_node_master_and_destroy(rank: int, world_size: int) -> None:
    coordinator = DistCoordinator()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        coordinator.print_on_node_master("per node")
        coordinator.print_on_master("once")
    assert printed.getvalue() == ("per node\n" if coordinator.local_rank == 0 else "") + ("once\n" if rank == 0 else "")
    # tensors, not all_gather_object: that one needs numpy, which cx-mesh does not depend on
    mine = torch.tensor([coordinator.local_rank, printed.getvalue().count("per node")])
    outputs = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(outputs, mine)
    assert sorted(tuple(o.tolist()) for o in outputs) == [(0, 1), (1, 0)]  # one node, two processes: the first prints
    group = dist.new_group([0, 1])
    coordinator.block_all(process_group=group)  # ColossalAI's keyword
    assert coordinator.is_master(process_group=group) == (rank == 0)
    coordinator.destroy(process_group=group)
    with pytest.raises(ValueError, match="not registered"):  # torch no longer knows the group
        dist.get_rank(group)
    dist.barrier()  # the default group is untouched


@distributed(world_size=2)
def test_logging_filters_by_rank_and_adds_rank(rank: int, world_size: int, tmp_path: Path) -> None:
    logger = get_dist_logger("cx.test")
    get_dist_logger("cx.test")  # a second call must not add a second handler
    assert sum(type(h).__name__ == "_CxHandler" for h in logger.logger.handlers) == 1
    records: list[logging.LogRecord] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    capture = Capture()
    logger.logger.addHandler(capture)
    try:
        logger.info("from rank 1 only", ranks=[1])
        logger.warning("from everyone")
    finally:
        logger.logger.removeHandler(capture)
    messages = [r.getMessage() for r in records]
    assert messages == (["from rank 1 only", "from everyone"] if rank == 1 else ["from everyone"])
    assert all(getattr(r, "rank", None) == rank for r in records)
    dist.barrier()


def test_accelerator_cpu_facts() -> None:
    accelerator = CpuAccelerator()
    assert accelerator.name == "cpu"
    assert accelerator.communication_backend == "gloo"
    assert accelerator.current_device() == torch.device("cpu")
    assert accelerator.memory_allocated() > 0
    assert accelerator.max_memory_allocated() >= accelerator.memory_allocated() // 2
    assert accelerator.total_memory() > 2**30
    accelerator.set_memory_capacity(123456)
    assert accelerator.total_memory() == 123456
    accelerator.set_memory_capacity(None)
    assert accelerator.total_memory() > 2**30
    with pytest.raises(ValueError, match="positive"):
        accelerator.set_memory_capacity(0)
    with accelerator.stream():
        accelerator.synchronize()
    if not torch.cuda.is_available():
        assert get_accelerator().name == "cpu"


def test_accelerator_offers_colossalai_spellings() -> None:
    # the calls ColossalAI scripts make on get_accelerator(), and colossalai.utils.get_current_device
    accelerator = get_accelerator()
    assert accelerator.get_current_device() == accelerator.current_device() == get_current_device()
    assert accelerator.is_available() == (accelerator.device_count() > 0)
    accelerator.manual_seed(5)
    first = torch.rand(3, device=accelerator.current_device())
    accelerator.manual_seed(5)
    assert torch.equal(first, torch.rand(3, device=accelerator.current_device()))
    accelerator.empty_cache()
    accelerator.reset_peak_memory_stats()
    assert accelerator.max_memory_allocated() >= 0


def test_disable_existing_loggers_spares_cx() -> None:
    chatty, own = logging.getLogger("cx_test_chatty_library"), logging.getLogger("cx.child")
    chatty.setLevel(logging.INFO)
    own.setLevel(logging.INFO)
    disable_existing_loggers(exclude=["cx"])
    assert chatty.level == logging.ERROR
    assert own.level == logging.INFO
    other = logging.getLogger("cx_test_other")
    other.setLevel(logging.DEBUG)
    disable_existing_loggers(include=["cx_test_other"])
    assert other.level == logging.ERROR
