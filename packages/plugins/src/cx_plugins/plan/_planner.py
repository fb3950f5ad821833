"""`plan(...)`: enumerate the candidates of a world size, judge each one's memory with the given memory model and
predict its step time, and rank them into a `PlanReport`. `judge(...)` does the same for one given candidate (what
`cx-train --plan` and a measurement harness ask for).

The memory model is passed in (any callable from a `Candidate` to a verdict with `fits`, `peak_bytes`, `reason`),
so the measured figures of a harness, or a cheaper model, can stand in for the FakeTensor-traced one.
"""

from __future__ import annotations

from collections.abc import Callable

from cx_plugins.plan._candidate import Candidate
from cx_plugins.plan._devices import Device, Network
from cx_plugins.plan._enumerate import SearchSpace, enumerate_candidates
from cx_plugins.plan._model_spec import ModelShape
from cx_plugins.plan._report import MemoryVerdict, PlanReport, PlanRow, rank_rows
from cx_plugins.plan._step_time import ACHIEVABLE_FRACTION, predict_step_time

__all__ = ["MemoryModel", "judge", "plan"]

MemoryModel = Callable[[Candidate], MemoryVerdict]


def judge(
    candidate: Candidate,
    shape: ModelShape,
    seq_len: int,
    device: Device,
    memory: MemoryModel,
    network: Network | None = None,
    efficiency: float = ACHIEVABLE_FRACTION,
) -> PlanRow:
    """One candidate's row: its memory verdict and predicted step time."""
    step = predict_step_time(candidate, shape, seq_len, device, network, efficiency)
    return PlanRow(candidate, memory(candidate), step)


def plan(
    shape: ModelShape,
    world: int,
    seq_len: int,
    device: Device,
    memory: MemoryModel,
    *,
    space: SearchSpace | None = None,
    network: Network | None = None,
    efficiency: float = ACHIEVABLE_FRACTION,
) -> PlanReport:
    """Every candidate for `world` devices, ranked: fitting ones by predicted step time, then the rest."""
    candidates = enumerate_candidates(shape, world, seq_len, space)
    rows = [judge(c, shape, seq_len, device, memory, network, efficiency) for c in candidates]
    return PlanReport(shape.name, world, seq_len, device, rank_rows(rows))
