"""`run_and_agree`: run one rank's part of a collective save, then share the outcome so that every rank of the
group raises the same `CheckpointSaveError` when any rank failed (instead of the others waiting forever in a
barrier, or aborting on mismatched collectives). The exchange doubles as the barrier that ends a save.
"""

from __future__ import annotations

from collections.abc import Callable

from cx_checkpoint._errors import CheckpointSaveError
from cx_mesh import ProcessGroup, all_gather_bytes

__all__ = ["run_and_agree"]


def run_and_agree(step: Callable[[], object] | None, what: str, group: ProcessGroup | None = None) -> None:
    """Run `step` (None: nothing to do on this rank), then exchange outcomes with every rank of `group`.

    Collective. Any rank's `Exception` becomes a `CheckpointSaveError` with the same message on every rank, built
    from the failing ranks' reports only (on a failing rank it is chained to the original error). Afterwards all
    ranks have made the same collective calls, so training can go on.
    """
    failure: Exception | None = None
    try:
        if step is not None:
            step()
    except Exception as error:
        failure = error
    report = b"" if failure is None else f"{what}: {type(failure).__name__}: {failure}".encode()
    reports = all_gather_bytes(report, group)
    failed = [(rank, message.decode(errors="replace")) for rank, message in enumerate(reports) if message]
    if failed:
        detail = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
        ranks = [rank for rank, _ in failed]
        raise CheckpointSaveError(f"checkpoint save failed on rank(s) {ranks}: {detail}") from failure
