"""Asynchronous saving: stage tensors to CPU now, write them in a background thread, re-raise errors on `synchronize`.

The background job runs exactly the code a synchronous save runs, on CPU copies taken before `save_*` returns, so
the files are byte-identical and training may keep updating the live tensors. Jobs run one at a time, in order;
a synchronous save through the same `CheckpointIO` first waits for them, so saves land in the order they are made.

A failed job is never lost: its error is raised by `synchronize()`, or by the next save through the same
`CheckpointIO` if that comes first, and one never awaited at all is reported on stderr when the process exits.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from cx_checkpoint._errors import CheckpointSaveError
from cx_checkpoint._files import alias_key
from cx_mesh import get_accelerator

__all__ = ["AsyncWriter", "stage_to_cpu"]


def stage_to_cpu(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Private CPU copies of `tensors` (page-locked where the accelerator supports it), complete on return."""
    accelerator = get_accelerator()
    pin = accelerator.is_pin_memory_available()
    staged: dict[str, torch.Tensor] = {}
    copies: dict[tuple[object, ...], torch.Tensor] = {}
    any_device = False
    for name, tensor in tensors.items():
        key = alias_key(tensor)  # tied weights are staged once and stay tied, as in a synchronous save
        if key not in copies:
            on_device = tensor.device.type != "cpu"
            any_device = any_device or on_device
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin and on_device)
            copy.copy_(tensor.detach(), non_blocking=pin and on_device)
            copies[key] = copy
        staged[name] = copies[key]
    if any_device:
        accelerator.synchronize()
    return staged


_LIVE_WRITERS: weakref.WeakSet[AsyncWriter] = weakref.WeakSet()


class AsyncWriter:
    """A single background writer thread and the futures of the jobs handed to it."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._futures: list[Future[None]] = []
        _LIVE_WRITERS.add(self)

    def submit(self, job: Callable[[], None]) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cx-checkpoint-writer")
        self._futures.append(self._executor.submit(job))

    def submit_after_success(self, job: Callable[[], None]) -> None:
        """Queue `job` behind the jobs queued so far; it runs only if none of them failed, else it fails itself (with
        the first failure as its cause) and does nothing: a commit that must not publish a half-written save."""
        earlier = list(self._futures)

        def guarded() -> None:
            failed = [error for future in earlier if (error := future.exception()) is not None]
            if failed:
                raise CheckpointSaveError(
                    f"skipped: an earlier asynchronous save failed ({type(failed[0]).__name__}: {failed[0]})"
                ) from failed[0]
            job()

        self.submit(guarded)

    def drain(self) -> None:
        """Wait until every submitted job has finished, leaving their errors for `synchronize`."""
        wait(self._futures)

    def raise_finished_failures(self) -> None:
        """Raise the error of a job that already failed (called at the start of every save and load): a failed
        asynchronous save whose result nobody awaited surfaces here rather than being lost. Jobs still running are
        left alone."""
        done = [future for future in self._futures if future.done()]
        errors = [error for future in done if (error := future.exception()) is not None]
        if errors:
            self._futures = [future for future in self._futures if not future.done()]
            for error in errors:
                error.add_note("cx-checkpoint: an earlier asynchronous save failed; reported at the next save or load")
            _raise_first(errors)

    def synchronize(self) -> None:
        """Wait for every submitted job; raise the first error (the others are chained in its notes)."""
        futures, self._futures = self._futures, []
        errors = [error for future in futures if (error := future.exception()) is not None]
        if errors:
            _raise_first(errors)

    def __del__(self) -> None:
        """Dropped with failures nobody received (e.g. its CheckpointIO was discarded): say so on stderr."""
        for future in getattr(self, "_futures", []):
            if future.done() and future.exception() is not None:
                _print_unawaited(future.exception())

    def report_unawaited(self) -> list[BaseException]:
        """Wait for the pending jobs and return the errors nobody received (at exit)."""
        futures, self._futures = self._futures, []
        return [error for future in futures if (error := future.exception()) is not None]


def _raise_first(errors: list[BaseException]) -> None:
    first = errors[0]
    for other in errors[1:]:
        first.add_note(f"another asynchronous save also failed: {type(other).__name__}: {other}")
    raise first


@atexit.register
def _report_at_exit() -> None:
    """A failed asynchronous save that was never awaited must not vanish silently when the process ends."""
    for writer in list(_LIVE_WRITERS):
        for error in writer.report_unawaited():
            _print_unawaited(error)


def _print_unawaited(error: BaseException | None) -> None:
    print(
        "cx-checkpoint: an asynchronous save failed and its result was never awaited (call synchronize() before "
        f"exiting): {type(error).__name__}: {error}",
        file=sys.stderr,
        flush=True,
    )
