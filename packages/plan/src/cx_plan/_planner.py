"""`plan(...)`: enumerate the candidates of a world size, judge each one's memory with the given memory model and
predict its step time, and rank them into a `PlanReport`. `judge(...)` does the same for one given candidate (what
`cx-train --plan` and a measurement harness ask for).

The memory model is passed in (any callable from a `Candidate` to a verdict with `fits`, `peak_bytes`, `reason`),
so the measured figures of a harness, or a cheaper model, can stand in for the FakeTensor-traced one.
`traced_memory_model` is the planner's own (`_memory_model.memory_model` for the device: FakeTensor traces shared by
the candidates that differ only in what a trace does not see, so a search over a world's hundreds of candidates
traces tens of times).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from cx_plan._candidate import Candidate
from cx_plan._devices import Device, Network
from cx_plan._enumerate import SearchSpace, enumerate_candidates, optimizer_skips
from cx_plan._report import MemoryVerdict, PlanReport, PlanRow, rank_rows
from cx_plan.memory._fits import Verdict
from cx_plan.memory._memory_model import memory_model
from cx_plan.step_time._kernels import EAGER, Kernels
from cx_plan.step_time._step_time import predict_step_time
from cx_plan.trace._model_spec import ModelShape, build_model, train_flags
from cx_plan.trace._op_counts import OpCounter, op_counter
from cx_plugins.fsdp import block_classes

__all__ = ["MemoryModel", "judge", "plan", "traced_memory_model"]

MemoryModel = Callable[[Candidate], MemoryVerdict]
Progress = Callable[[int, int, int], None]  # (judged, to judge at most, fitting so far)


def traced_memory_model(shape: ModelShape, seq_len: int, device: Device) -> Callable[[Candidate], Verdict]:
    """The planner's memory model for `device` (`_memory_model.memory_model` at the usable fraction `fits` uses; on
    the `cpu` device offloaded optimizer states stay in the memory that peaks)."""
    return memory_model(
        shape, seq_len, device.memory_bytes, usable_fraction=1.0 - device.reserve, host_is_device=device.name == "cpu"
    )


def judge(
    candidate: Candidate,
    shape: ModelShape,
    seq_len: int,
    device: Device,
    memory: MemoryModel,
    network: Network | None = None,
    efficiency: float | None = None,  # None: the device row's
    ops: OpCounter | None = None,
    kernels: Kernels = EAGER,
) -> PlanRow:
    """One candidate's row: its memory verdict and predicted step time (`ops`: the op counts, traced by default)."""
    counts = (op_counter(shape, seq_len, device.host_bound) if ops is None else ops)(candidate)
    step = predict_step_time(candidate, shape, seq_len, device, network, efficiency, counts, kernels)
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
    efficiency: float | None = None,  # None: the device row's
    enough: int | None = None,
    ops: OpCounter | None = None,
    progress: Progress | None = None,
    time_limit: float | None = None,
    kernels: Kernels = EAGER,
) -> PlanReport:
    """The candidates for `world` devices, ranked: fitting ones by predicted step time, then the rest.

    The step time of every candidate is cheap; its memory verdict (a trace) is not. With `enough`, memory is judged
    in order of predicted step time and the search stops once `enough` candidates fit: the fastest fitting ones are
    then exactly those a full search would rank first, and the rows hold the misses met on the way. None judges all.
    `ops` gives each candidate's op and tensor counts for the host terms (default: traced, one trace per distinct
    split on a host-bound device, the whole model's shared out on a GPU, see `_op_counts`). `progress` is called
    after each judged candidate; past `time_limit` seconds no further candidate is judged, and the report says it
    stopped (its rows are the best found so far: the fastest predicted of those judged). `kernels`: torch.compile's
    factor and fp8 linear layers for every candidate's step time.
    """
    if enough is not None and enough < 1:
        raise ValueError(f"enough must be a positive number of fitting candidates, got {enough}")
    start = time.monotonic()
    candidates = enumerate_candidates(shape, world, seq_len, space)
    count = op_counter(shape, seq_len, device.host_bound) if ops is None else ops
    timed = [
        (predict_step_time(c, shape, seq_len, device, network, efficiency, count(c), kernels), c) for c in candidates
    ]
    timed.sort(key=lambda pair: pair[0].step_s)
    rows: list[PlanRow] = []
    fitting, stopped = 0, None
    total = len(timed)
    for step, candidate in timed:
        if time_limit is not None and time.monotonic() - start > time_limit:
            stopped = (
                f"stopped at the time limit ({time_limit:g} s) after judging {len(rows)} of {len(timed)} candidates "
                f"(fastest predicted first): the rows are the best found so far; raise --time-limit for the rest"
            )
            break
        row = PlanRow(candidate, memory(candidate), step)
        rows.append(row)
        fitting += row.memory.fits
        if progress is not None:
            progress(len(rows), total, fitting)
        if enough is not None and fitting >= enough:
            break
    ranked = rank_rows(rows)
    return PlanReport(
        shape.name, world, seq_len, device, ranked, considered=len(candidates), model_flags=train_flags(shape),
        block_class=_block_class(shape) if any(r.candidate.fsdp_wrap == "block" for r in ranked) else None,
        stopped=stopped, routing_skew=1.0 if space is None else space.routing_skew,
        expert_load=_expert_load_note(space, candidates),
        skipped=() if space is None else optimizer_skips(space, shape, world),
    )  # fmt: skip


def _expert_load_note(space: SearchSpace | None, candidates: list[Candidate]) -> str | None:
    if space is None or space.expert_load is None:
        return None
    return space.expert_load.describe(sorted({c.ep for c in candidates if c.plugin == "moe_hybrid"}))


def _block_class(shape: ModelShape) -> str:
    """The decoder layer's class name(s), for per-block FSDP's `ModuleWrapPolicy({...})` (built on meta)."""
    with torch.device("meta"):
        model = build_model(shape)
    return ", ".join(cls.__name__ for cls in block_classes(model))
