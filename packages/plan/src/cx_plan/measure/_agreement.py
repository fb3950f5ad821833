"""Does a predicted order of configurations agree with their measured step times? Strictly (the measured medians
sort into exactly the predicted order), and up to noise: two configurations whose measured medians differ by less
than the larger of their measured spreads are a tie, which either order matches.

A configuration's spread is how far its median moved between repeated rounds of the same measurement (the range of
its per-round medians): a difference smaller than that is one a re-measurement could reverse, so it says nothing
about which of the two is faster.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Agreement", "Timing", "agreement", "timing"]


@dataclass(frozen=True)
class Timing:
    """One configuration's measured step time: the median over all its steps and the spread of its round medians."""

    median: float
    spread: float


def timing(rounds: Sequence[Sequence[float]]) -> Timing:
    """The `Timing` of step times measured in `rounds` (each a non-empty list of steps)."""
    if not rounds or not all(rounds):
        raise ValueError("timing needs at least one round of at least one step")
    medians = [statistics.median(steps) for steps in rounds]
    return Timing(statistics.median([t for steps in rounds for t in steps]), max(medians) - min(medians))


@dataclass(frozen=True)
class Agreement:
    strict: bool  # the measured medians sort into the predicted order
    within_noise: bool  # every pair is in the predicted order or a tie within its spread


def agreement(predicted: Sequence[str], measured: Mapping[str, Timing]) -> Agreement:
    """Compare `predicted` (names, fastest first) with the measured timings of the same names."""
    missing = [name for name in predicted if name not in measured]
    if missing:
        raise ValueError(f"no measurement for {', '.join(missing)}")
    by_time = sorted(predicted, key=lambda name: measured[name].median)
    noise_ok = True
    for i, faster in enumerate(predicted):
        for slower in predicted[i + 1 :]:
            a, b = measured[faster], measured[slower]
            if a.median > b.median and a.median - b.median >= max(a.spread, b.spread):
                noise_ok = False
    return Agreement(list(predicted) == by_time, noise_ok)
