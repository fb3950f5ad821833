"""`spawn`: run a function on N fresh processes that form a torch.distributed group, and report any failure.

Rendezvous is a `FileStore` in a private temporary directory, so concurrent tests can never collide on a port.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from cx_mesh.testing._pool import run_in_pool
from cx_mesh.testing._processes import RankHandle, collect, context, kill_all
from cx_mesh.testing._worker import FunctionRef, Outcome, Task, single_worker_main

__all__ = ["DEFAULT_TIMEOUT_SECONDS", "run_distributed", "spawn"]

DEFAULT_TIMEOUT_SECONDS = 120.0


def spawn(
    function: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    threads: int = 1,
    init_process_group: bool = True,
    **kwargs: Any,
) -> dict[int, Outcome]:
    """Run `function(rank, world_size, *args, **kwargs)` on `world_size` new processes; return each rank's outcome.

    The processes join one process group (`backend`, default gloo) unless `init_process_group=False`. Any rank that
    raises, exits early or is still running after `timeout` seconds fails the call with
    `DistributedTestFailure`, naming the ranks and carrying their tracebacks; no process outlives the call.
    `function` must be defined at module level.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    task = Task(FunctionRef.of(function), tuple(args), dict(kwargs))
    workdir = tempfile.mkdtemp(prefix="cx-spawn-")
    store_path = os.path.join(workdir, "store")
    ctx = context()
    handles: list[RankHandle] = []
    try:
        for rank in range(world_size):
            receive, send = ctx.Pipe(duplex=False)
            process = ctx.Process(  # type: ignore[attr-defined]
                target=single_worker_main,
                args=(
                    task,
                    rank,
                    world_size,
                    backend,
                    store_path,
                    timeout,
                    threads,
                    send,
                    init_process_group,
                ),
                name=f"cx-rank-{rank}",
                daemon=False,
            )
            process.start()
            send.close()
            handles.append(RankHandle(rank, process, receive))
        outcomes = collect(handles, timeout, f"{task.function.qualname} on {world_size} rank(s)")
        for handle in handles:
            handle.process.join(timeout=5)
        return outcomes
    finally:
        kill_all(handles)
        shutil.rmtree(workdir, ignore_errors=True)


def run_distributed(
    function: Callable[..., Any],
    world_size: int,
    *,
    fresh: bool = False,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
    threads: int = 1,
    **kwargs: Any,
) -> dict[int, Outcome]:
    """Run `function(rank, world_size, **kwargs)` on the pooled ranks of this world size (or fresh ones).

    For tests that orchestrate several distributed phases, e.g. save at 2 ranks then load at 4.
    """
    if fresh:
        return spawn(function, world_size, backend=backend, timeout=timeout, threads=threads, **kwargs)
    return run_in_pool(FunctionRef.of(function), world_size, kwargs, backend=backend, timeout=timeout, threads=threads)
