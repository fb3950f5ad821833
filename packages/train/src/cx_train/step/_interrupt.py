"""Ctrl-C stops every rank at the same step boundary, cleanly, with one line.

Ranks run in their own session under torch's launcher, so a Ctrl-C reaches the launcher, which passes SIGINT on to
each rank once (`_cli`). A rank only notes it (`stop_requested`); after every step the ranks agree whether any of
them was asked to stop, inside the all-reduce that already sums the step's loss (`Progress.record`), and then all
raise `Interrupted` together, after the step's save if one was due: no rank is left waiting in a collective for one
that already left (what printed a traceback per rank and gloo's errors before), and a save in progress completes
rather than leaving a half-written staging directory.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

__all__ = ["Interrupted", "install_stop_handler", "stop_requested"]

_requested = False


@dataclass
class Interrupted(Exception):
    """The ranks stopped at `step` of `total`, on request; `saved` is the last step this run checkpointed."""

    step: int
    total: int
    saved: int | None
    directory: Path | None

    def __str__(self) -> str:
        where = f"interrupted at step {self.step}/{self.total}"
        if self.directory is None:
            return f"{where}; nothing saved (no --save)"
        if self.saved is None:
            return (
                f"{where}; nothing saved by this run (--save {self.directory} saves at the end or every --save-every)"
            )
        return f"{where}; step {self.saved} is saved in {self.directory} (--resume {self.directory} continues from it)"


def _note(signum: int, frame: FrameType | None) -> None:
    global _requested
    _requested = True


def install_stop_handler() -> None:
    """From now on SIGINT asks this rank to stop at the next step boundary instead of raising KeyboardInterrupt."""
    signal.signal(signal.SIGINT, _note)


def stop_requested() -> bool:
    """Whether this rank was asked to stop (the ranks agree on it in `Progress.record`)."""
    return _requested
