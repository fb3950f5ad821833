"""`--max-restarts N`: when a rank dies or a collective fails, torchrun restarts every rank (its elastic agent, up to N
times) and the new ranks resume from the latest complete checkpoint in `--save` by themselves: the data position,
the schedule and the optimizer come back exactly as a `--resume` would bring them, and the metrics file drops the
lines of the steps that are trained again. Rank 0 notes the step each step reached beside the folder, so the restart
can say how many steps it redoes.

Under an elastic launch (`--nnodes MIN:MAX`) a restart may come back with fewer or more ranks. The run keeps the
checkpoint's global batch (data-parallel size x `--batch-size` x `--grad-accum`): each rank's `--batch-size` becomes
that global batch over the new data-parallel size, so the restarted run trains on the same windows in the same order
(the data order is defined by the window index, not by the ranks) and its losses are the uninterrupted run's but for
the rounding of averaging over another number of ranks.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from cx_train.checkpoint._trainer_state import STATE_FILE, read_trainer_state
from cx_train.config._options import TrainOptions

__all__ = ["RESTART_VARIABLE", "note_reached", "restart_line", "restarted"]

RESTART_VARIABLE = "TORCHELASTIC_RESTART_COUNT"  # torchrun's: 0 on the first start, then 1, 2, ...


def _reached_path(save: Path) -> Path:
    return save.parent / f".{save.name}.cx-reached"


def restarted(options: TrainOptions, world_size: int) -> TrainOptions:
    """These options on a restarted rank: resume from `--save` when it holds a complete checkpoint (else from the
    run's own `--resume`, or from the start), remember which restart this is, and keep the checkpoint's global batch
    when this restart has another data-parallel size (module docs)."""
    count = int(os.environ.get(RESTART_VARIABLE, "0") or 0)
    if count == 0 or options.save is None:
        return options
    latest = options.save if (options.save / STATE_FILE).is_file() else options.resume
    options = replace(options, resume=latest, restart=count)
    if latest is None:
        return options
    saved_dp = options.data_parallel_size(read_trainer_state(latest).world_size)
    dp = options.data_parallel_size(world_size)
    if saved_dp == dp:
        return options
    global_batch = saved_dp * options.batch_size
    if global_batch % dp:
        raise ValueError(
            f"cx-train: restart {count} came back with data-parallel size {dp}, which does not divide the "
            f"checkpoint's global batch of {global_batch} sequences (data-parallel size {saved_dp} x --batch-size "
            f"{options.batch_size}): run with a node count whose data-parallel size divides it"
        )
    return replace(options, batch_size=global_batch // dp, resized_from=saved_dp)


def note_reached(options: TrainOptions, step: int) -> None:
    """Rank 0, with `--max-restarts`: the step this run has reached (a tiny file beside `--save`, replaced whole)."""
    if options.max_restarts and options.save is not None:
        path = _reached_path(options.save)
        temporary = path.with_name(f"{path.name}.{os.getpid()}")
        temporary.write_text(f"{step}\n")
        os.replace(temporary, path)


def restart_line(options: TrainOptions, step: int, world_dp: int) -> str:
    """What rank 0 prints on a restart: which one, from where, and how many steps are trained again."""
    try:
        reached = int(_reached_path(options.save).read_text()) if options.save is not None else None
    except (OSError, ValueError):
        reached = None
    source = f"the checkpoint in {options.resume} at step {step}" if options.resume is not None else "the start"
    redone = "" if reached is None else f"; the failed run had reached step {reached}, {reached - step} step(s) redone"
    of = f" of {options.max_restarts}" if options.max_restarts else ""  # an outside torchrun's count is its own
    resized = ""
    if options.resized_from is not None:
        resized = (
            f"; data-parallel size {world_dp} (the checkpoint's was {options.resized_from}), {options.batch_size} "
            f"sequences per rank keep its global batch of {world_dp * options.batch_size}"
        )
    return f"cx-train: restart {options.restart}{of} after a rank failed: resuming from {source}{redone}{resized}"
