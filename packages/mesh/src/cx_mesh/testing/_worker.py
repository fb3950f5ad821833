"""What runs inside each test process: join the group, run the function, report, exit without torch's teardown.

Results travel over a pipe, never through the exit code: on torch 2.13 CPU a rank sometimes aborts at interpreter
exit ("terminate called without an active exception") after its work succeeded. Workers therefore report first,
then leave with `os._exit`, so a clean run is never mistaken for a failure and a real failure is never lost.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FileStore  # public as dist.FileStore; its stub does not declare it

from cx_mesh import report_failure, set_accelerator
from cx_mesh.testing._per_test import clear_per_test_caches

__all__ = ["FunctionRef", "Outcome", "Task", "pool_worker_main", "single_worker_main"]

INNER_ATTRIBUTE = "__cx_distributed_inner__"


@dataclass(frozen=True)
class FunctionRef:
    """A module-level function named by module and qualified name, resolved (and unwrapped) in the worker."""

    module: str
    qualname: str

    @classmethod
    def of(cls, function: Any) -> FunctionRef:
        qualname = getattr(function, "__qualname__", "")
        module = getattr(function, "__module__", None)
        if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
            raise TypeError(
                f"{function!r} cannot run in another process: pass a function defined at module level "
                "(not a lambda or a nested function)"
            )
        return cls(module, qualname)

    def resolve(self) -> Any:
        target: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            target = getattr(target, part)
        while hasattr(target, INNER_ATTRIBUTE):
            target = getattr(target, INNER_ATTRIBUTE)
        return target


@dataclass(frozen=True)
class Task:
    function: FunctionRef
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """One rank's report: ok, or the formatted traceback of what it raised."""

    rank: int
    ok: bool
    error: str | None = None
    skipped: str | None = None  # the reason, when the function called pytest.skip (counts as ok)


def _prepare_process(threads: int, backend: str) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _init_group(rank: int, world_size: int, backend: str, store_path: str, timeout: float) -> None:
    store = FileStore(store_path, world_size)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))


def _skip_reason(error: BaseException) -> str | None:
    """The message of a pytest skip raised inside the function (pytest is not imported to find out)."""
    kind = type(error)
    if kind.__name__ == "Skipped" and any(base.__module__.startswith("_pytest") for base in kind.__mro__):
        return str(getattr(error, "msg", "") or error)
    return None


def _run(task: Task, rank: int, world_size: int) -> Outcome:
    try:
        task.function.resolve()(rank, world_size, *task.args, **task.kwargs)
    except BaseException as error:
        reason = _skip_reason(error)
        if reason is not None:
            return Outcome(rank, ok=True, skipped=reason)
        report_failure(error)  # peers waiting for this rank stop with its error (PeerFailedError), not a timeout
        return Outcome(rank, ok=False, error=traceback.format_exc())
    return Outcome(rank, ok=True)


def _reset_process_state() -> None:
    """Undo process-wide settings a previous pooled test may have changed, so tests stay independent."""
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.manual_seed(0)
    accelerator = set_accelerator("cuda" if torch.cuda.is_available() else "cpu")
    accelerator.set_memory_capacity(None)


def _live_groups() -> list[Any]:
    """The process groups this process holds, in creation order. torch keeps no public list of them; its private
    registry is read defensively (an empty list if it moves, which only forgoes the clean-up below)."""
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return list(registry) if isinstance(registry, dict) else []


def _release_groups(kept: list[Any]) -> None:
    """Destroy the groups a pooled task created. Every rank ran the same task, so all created the same groups; left
    alive, each idle gloo group keeps three native threads polling (measured: 100 groups cost a tenth of a core), and
    a pooled rank accumulates hundreds over a suite."""
    before = set(map(id, kept))
    created = [group for group in _live_groups() if id(group) not in before]
    # On every rank, even one that created nothing: a rank outside a group does not hold it, and a barrier only some
    # ranks entered would pair with the next test's first collective on the others.
    dist.barrier()  # and no rank may still be using a group another destroys
    for group in created:
        dist.destroy_process_group(group)


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def single_worker_main(
    task: Task,
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    timeout: float,
    threads: int,
    report: Connection,
    init_group: bool,
) -> None:
    """Entry point of a fresh process: optional group init, one task, report, hard exit."""
    _prepare_process(threads, backend)
    try:
        if init_group:
            _init_group(rank, world_size, backend, store_path, timeout)
    except BaseException:
        report.send(Outcome(rank, ok=False, error="process group initialisation failed:\n" + traceback.format_exc()))
        _leave(1)
    outcome = _run(task, rank, world_size)
    report.send(outcome)
    if outcome.ok and init_group and dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except BaseException:  # the result is already reported; teardown problems do not change it
            pass
    _leave(0 if outcome.ok else 1)


def pool_worker_main(
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    timeout: float,
    threads: int,
    tasks: Connection,
    report: Connection,
) -> None:
    """Entry point of a pooled process: init the group once, then run tasks until told to stop (None)."""
    _prepare_process(threads, backend)
    try:
        _init_group(rank, world_size, backend, store_path, timeout)
    except BaseException:
        report.send(Outcome(rank, ok=False, error="process group initialisation failed:\n" + traceback.format_exc()))
        _leave(1)
    report.send(Outcome(rank, ok=True))  # ready
    while True:
        task = tasks.recv()
        if task is None:
            break
        _reset_process_state()
        kept = _live_groups()
        outcome = _run(task, rank, world_size)
        report.send(outcome)
        clear_per_test_caches()
        if outcome.ok:  # a failed task discards the whole pool
            _release_groups(kept)
    try:
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        pass
    _leave(0)
