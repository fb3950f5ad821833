"""A pool of ranks kept alive across tests: the process group is created once per (world size, backend).

PyTorch's own continuous multi-process tests do the same: most distributed test cases only need a group to exist,
so paying process start and rendezvous once per session lets hundreds of cases fit the CI budget. Any failure (a
raise, an early exit, a hang) tears the pool down; the next test starts a fresh one, so failures never leak.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from typing import Any

from cx_mesh.testing._processes import RankHandle, collect, context, kill_all
from cx_mesh.testing._worker import FunctionRef, Outcome, Task, pool_worker_main

__all__ = ["WorkerPool", "run_in_pool", "shutdown_pools"]

_STARTUP_TIMEOUT_SECONDS = 60.0


class WorkerPool:
    def __init__(self, world_size: int, backend: str, threads: int, collective_timeout: float) -> None:
        self.world_size = world_size
        self._workdir = tempfile.mkdtemp(prefix="cx-pool-")
        ctx = context()
        self._handles: list[RankHandle] = []
        self._task_pipes = []
        store_path = os.path.join(self._workdir, "store")
        for rank in range(world_size):
            receive_report, send_report = ctx.Pipe(duplex=False)
            receive_task, send_task = ctx.Pipe(duplex=False)
            process = ctx.Process(  # type: ignore[attr-defined]
                target=pool_worker_main,
                args=(
                    rank,
                    world_size,
                    backend,
                    store_path,
                    collective_timeout,
                    threads,
                    receive_task,
                    send_report,
                ),
                name=f"cx-pool-rank-{rank}",
            )
            process.start()
            send_report.close()
            receive_task.close()
            self._handles.append(RankHandle(rank, process, receive_report))
            self._task_pipes.append(send_task)
        try:
            collect(self._handles, _STARTUP_TIMEOUT_SECONDS, f"starting a pool of {world_size} rank(s)")
        except BaseException:
            self.close(graceful=False)
            raise

    def run(self, task: Task, timeout: float) -> dict[int, Outcome]:
        for pipe in self._task_pipes:
            pipe.send(task)
        return collect(self._handles, timeout, f"{task.function.qualname} on {self.world_size} rank(s)")

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for pipe in self._task_pipes:
                with contextlib.suppress(OSError):
                    pipe.send(None)
            for handle in self._handles:
                handle.process.join(timeout=10)
        kill_all(self._handles)
        for pipe in self._task_pipes:
            pipe.close()
        shutil.rmtree(self._workdir, ignore_errors=True)


_pools: dict[tuple[int, str, int], WorkerPool] = {}


def run_in_pool(
    function: FunctionRef,
    world_size: int,
    kwargs: dict[str, Any],
    *,
    backend: str,
    timeout: float,
    threads: int,
) -> dict[int, Outcome]:
    """Run one task on the pooled ranks for this shape and return each rank's outcome; a failure discards the pool."""
    key = (world_size, backend, threads)
    pool = _pools.get(key)
    if pool is None:
        pool = WorkerPool(world_size, backend, threads, collective_timeout=timeout)
        _pools[key] = pool
    try:
        return pool.run(Task(function, (), kwargs), timeout)
    except BaseException:
        _pools.pop(key, None)
        pool.close(graceful=False)
        raise


@atexit.register
def shutdown_pools() -> None:
    """Stop every pool (called at interpreter exit, and usable from a pytest session-finish hook)."""
    while _pools:
        _, pool = _pools.popitem()
        pool.close()
