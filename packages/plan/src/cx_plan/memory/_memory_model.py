"""`memory_model`: the planner's one memory model. Traces each candidate's first and last pipeline stage (shared
between candidates that differ only in what a trace does not see: `TraceCache`), predicts the busiest stage and judges
it with `fits`, so `cx-plan`, `cx-train --plan` and a measurement harness read the same verdicts.

A candidate of micro-batch size k > 1 is first bounded from below by its micro-batch-1 trace (shared by every
micro-batch size of its split), and for k > 2 then by the traces at 1 and 2 (`floor_trace`). When that floor
already exceeds the usable memory the candidate does not fit and is not traced (its row says so and gives the floor
as its peak); the verdict, fits or not, is the one the full trace gives (tested), and a search of an 8B model at
seq 8192, whose layouts without checkpointing miss by far, traces a fraction of what it did.

A candidate cx's own validation refuses (ValueError / NotImplementedError: a split cx cannot make of this model, say)
does not fit, with "cx refuses: <cx's message>". Any other exception during a candidate's trace is a fault of the
trace, not a verdict on the configuration: its row does not fit, with "trace failed: <type>: <message>", and the rest
of the search goes on. `PlanTraceError` (the trace cannot run in this process at all) still ends the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from cx_plan._candidate import Candidate
from cx_plan.memory._fits import USABLE_FRACTION, Verdict, fits
from cx_plan.memory._memory import MemoryPrediction, predict_memory_from_traces
from cx_plan.trace._activations import ActivationTrace
from cx_plan.trace._model_spec import ModelShape
from cx_plan.trace._muon_split import muon_split
from cx_plan.trace._trace_cache import TraceCache, shared_trace_cache

__all__ = ["floor_trace", "memory_model"]


def floor_trace(candidate: Candidate, one: ActivationTrace, two: ActivationTrace | None = None) -> ActivationTrace:
    """A trace whose prediction for `candidate` is at most that of its own trace, made from the traces of the same
    split at micro-batch 1 (`one`) and, for micro-batch k > 2, 2 (`two`).

    Every tensor of a micro-batch of k sequences is at least as large as at 1, so the peak's bytes above the
    parameters W(k) are at least W(1); they grow about linearly in k (batch-sized tensors beside constant ones), so
    for k > 2 the floor is W(2) + (W(2) - W(1)) (k - 2) / 2: half the slope, as the growth came out up to 0.3 %
    short of linear on tiny models (a few KB, against a margin of half a sequence's activations per extra one;
    checked on every candidate of a small search). The forward's saved activations only grow (taken at the
    largest traced micro-batch, not extrapolated). How the peak splits into activations and live gradients does
    not follow k, so the floor puts all of W where no plugin scales it down (activations; gradients 0). FSDP per
    block caps the live gradients and Gemini ignores them: there only the saved activations (which W is never
    below) count, and Gemini's peak keeps none (its activations alone are not bounded by the trace's sum)."""
    k = candidate.micro_batch_size

    def grown(first: int, second: int) -> int:
        return second + max(second - first, 0) * (k - 2) // 2 if two is not None and k > 2 else first

    working_one = one.activation_bytes + one.gradient_bytes
    working = working_one if two is None else grown(working_one, two.activation_bytes + two.gradient_bytes)
    saved = one.saved_bytes if two is None else two.saved_bytes
    if candidate.plugin == "torch_fsdp":
        working = saved
    elif candidate.plugin == "gemini":
        working = 0
    return dataclasses.replace(one, activation_bytes=working, gradient_bytes=0, saved_bytes=saved)


def memory_model(
    shape: ModelShape,
    seq_len: int,
    device_memory: int,
    usable_fraction: float = USABLE_FRACTION,
    host_is_device: bool = False,
    cache: TraceCache | None = None,
    bound: bool = True,
) -> Callable[[Candidate], Verdict]:
    """Trace, predict and judge each candidate against `usable_fraction` of `device_memory` bytes (`host_is_device`:
    the devices are the CPU, where offloaded optimizer states count). `cache`: the traces to share (default: this
    process's for the model); `bound`: rule out by the micro-batch-1 floor before tracing (False traces every one)."""
    if device_memory <= 0:
        raise ValueError(f"device memory must be positive, got {device_memory}")
    traces = shared_trace_cache(shape, seq_len) if cache is None else cache
    limit = int(device_memory * usable_fraction)

    def stage_traces(candidate: Candidate) -> list[ActivationTrace] | Verdict:
        made = []
        for stage in sorted({0, candidate.pp - 1}):
            trace = traces.get(candidate, stage)
            if isinstance(trace, str):
                return Verdict(False, 0, limit, trace, MemoryPrediction(candidate, stage, 0, 0, 0, 0, 0, 0, 0, 0))
            made.append(trace)
        return made

    def floor(candidate: Candidate, smaller: tuple[int, ...]) -> Verdict | None:
        """The verdict of the floor from the traces at the `smaller` micro-batch sizes when it already does not fit
        (None: it fits, or a smaller trace failed; then the candidate is traced)."""
        made = [stage_traces(dataclasses.replace(candidate, micro_batch_size=size)) for size in smaller]
        if any(isinstance(stages, Verdict) for stages in made):
            return None
        stage_lists = [stages for stages in made if not isinstance(stages, Verdict)]
        floors = [floor_trace(candidate, *traces) for traces in zip(*stage_lists, strict=True)]
        prediction = predict_memory_from_traces(
            candidate, floors, shape.parameters, host_is_device, muon_split(shape) if candidate.muon else None
        )
        verdict = fits(prediction, device_memory, usable_fraction)
        if verdict.fits:
            return None
        sizes = " and ".join(map(str, smaller))
        reason = f"{verdict.reason} (at least: the bound from the traces at micro-batch {sizes}, not traced itself)"
        return dataclasses.replace(verdict, reason=reason.replace("peak ", "peak >= ", 1))

    def judge(candidate: Candidate) -> Verdict:
        if (
            bound
            and candidate.micro_batch_size > 1
            and not all(traces.has(candidate, stage) for stage in {0, candidate.pp - 1})
        ):
            for smaller in ((1,), (1, 2))[: 1 + (candidate.micro_batch_size > 2)]:
                ruled_out = floor(candidate, smaller)
                if ruled_out is not None:
                    return ruled_out
        made = stage_traces(candidate)
        if isinstance(made, Verdict):
            return made
        split = muon_split(shape) if candidate.muon else None
        prediction = predict_memory_from_traces(candidate, made, shape.parameters, host_is_device, split)
        return fits(prediction, device_memory, usable_fraction)

    return judge
