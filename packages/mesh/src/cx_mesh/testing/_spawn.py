"""`spawn`: run a function on N fresh processes that form a torch.distributed group, and report any failure.

Rendezvous is a `FileStore` in a private temporary directory, so concurrent tests can never collide on a port.
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from cx_mesh.testing._colossalai import free_port
from cx_mesh.testing._pool import run_in_pool
from cx_mesh.testing._processes import RankHandle, collect, context, kill_all
from cx_mesh.testing._worker import FunctionRef, Outcome, Task, single_worker_main

__all__ = ["DEFAULT_TIMEOUT_SECONDS", "default_timeout", "run_distributed", "spawn"]

DEFAULT_TIMEOUT_SECONDS = 120.0  # for as many ranks as CPU cores; more ranks than cores scale it (`default_timeout`)
TIMEOUT_VARIABLE = "CX_TEST_TIMEOUT"


def default_timeout(world_size: int) -> float:
    """How long a run of `world_size` ranks may take when the caller names no timeout: `CX_TEST_TIMEOUT` seconds
    when set, otherwise 120 s scaled by how many ranks share each CPU core this process may use (4 ranks on a
    2-core machine: 240 s), since oversubscribed ranks run in turns. ColossalAI's `spawn` has no limit at all; a 4-rank
    ColossalAI test on a busy 2-core machine was killed at a flat 120 s although it passes alone."""
    configured = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if configured:
        try:
            seconds = float(configured)
        except ValueError:
            raise ValueError(f"{TIMEOUT_VARIABLE}={configured!r}: not a number of seconds") from None
        if not seconds > 0:
            raise ValueError(f"{TIMEOUT_VARIABLE}={configured!r}: must be a positive number of seconds")
        return seconds
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return DEFAULT_TIMEOUT_SECONDS * max(1.0, world_size / max(1, cores))


def spawn(
    function: Callable[..., Any],
    world_size: int | None = None,
    *args: Any,
    nprocs: int | None = None,
    backend: str = "gloo",
    timeout: float | None = None,
    threads: int = 1,
    init_process_group: bool | None = None,
    **kwargs: Any,
) -> dict[int, Outcome]:
    """Run `function(rank, world_size, *args, **kwargs)` on `world_size` new processes; return each rank's outcome.

    The processes join one process group (`backend`, default gloo) unless `init_process_group=False`. Any rank that
    raises, exits early or is still running after `timeout` seconds (default: `default_timeout(world_size)`) fails the
    call with
    `DistributedTestFailure`, naming the ranks and carrying their tracebacks; no process outlives the call.
    `function` must be defined at module level.

    ColossalAI's form works too: `spawn(run_dist, nprocs=2, **kwargs)` with `run_dist(rank, world_size, port)`. A
    function that takes a `port` parameter (and is not given one) gets a free port and no process group: it calls
    `launch(rank, world_size, host, port)` itself, as ColossalAI's tests do.
    """
    if world_size is None:
        world_size = nprocs if nprocs is not None else 1
    elif nprocs is not None and nprocs != world_size:
        raise ValueError(f"spawn: world_size={world_size} and nprocs={nprocs} disagree; pass one of them")
    if _wants_port(function, world_size, args, kwargs):
        kwargs["port"] = free_port()
        if init_process_group is None:
            init_process_group = False
    init_process_group = True if init_process_group is None else init_process_group
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    timeout = default_timeout(world_size) if timeout is None else timeout
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
    timeout: float | None = None,
    threads: int = 1,
    **kwargs: Any,
) -> dict[int, Outcome]:
    """Run `function(rank, world_size, **kwargs)` on the pooled ranks of this world size (or fresh ones).

    For tests that orchestrate several distributed phases, e.g. save at 2 ranks then load at 4.
    """
    timeout = default_timeout(world_size) if timeout is None else timeout
    if fresh:
        return spawn(function, world_size, backend=backend, timeout=timeout, threads=threads, **kwargs)
    return run_in_pool(FunctionRef.of(function), world_size, kwargs, backend=backend, timeout=timeout, threads=threads)


def _wants_port(function: Callable[..., Any], world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether `function` takes a `port` that this call leaves unbound (ColossalAI's self-launching form)."""
    signature = inspect.signature(function)
    if "port" not in signature.parameters:
        return False
    try:
        bound = signature.bind_partial(0, world_size, *args, **kwargs)
    except TypeError:
        return False
    return "port" not in bound.arguments
