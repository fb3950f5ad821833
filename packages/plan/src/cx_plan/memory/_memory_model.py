"""`memory_model`: the planner's one memory model. Traces each candidate's first and last pipeline stage (shared
between candidates that differ only in what a trace does not see: `TraceCache`), predicts the busiest stage and judges
it with `fits`, so `cx-plan`, `cx-train --plan` and a measurement harness read the same verdicts.

Before a candidate is traced, bounds try to rule it out, cheapest first; each predicts at most what the candidate's
own trace would (tested on every candidate of small searches), so a verdict, fits or not, is the one the full trace
gives, and a ruled-out row says which bound and gives it as its peak ("peak >= ..."):
- the model states alone (`_states_floor`: parameter counts, no trace);
- where the states take half the memory or more (`crowded`): the frugal split's first stage (micro-batch 1, every
  layer checkpointed in full), of the shallower model where the stage is extrapolated: one trace of a few layers
  for every micro-batch and checkpointing choice of the split, short stages included;
- a stage deeper than a few layers: stage 0 of the shallower model its trace extrapolates from, at micro-batch 1
  (one trace of a few layers instead of up to four);
- the same split's first stage at micro-batch 1 with every layer checkpointed in full (its least memory: one trace
  rules out every micro-batch and checkpointing choice of a split that cannot fit);
- micro-batch k > 1: the traces at micro-batch 1, and for k > 2 at 1 and 2 (`floor_trace`);
- a pipeline: its own first stage, before its last is traced.
A Mixtral-8x7B-shaped search at seq 8192, whose fastest layouts all miss by far, so became a few minutes' work.

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
from cx_plan.memory._memory import MemoryPrediction, predict_for_shape
from cx_plan.memory._states_floor import states_floor, with_states_floor
from cx_plan.trace._activations import ActivationTrace, shallow_layers
from cx_plan.trace._model_spec import ModelShape
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
    process's for the model); `bound`: rule out by the bounds above before tracing (False traces every one)."""
    if device_memory <= 0:
        raise ValueError(f"device memory must be positive, got {device_memory}")
    traces = shared_trace_cache(shape, seq_len) if cache is None else cache
    limit = int(device_memory * usable_fraction)

    def stage_traces(candidate: Candidate, stages: tuple[int, ...] | None = None) -> list[ActivationTrace] | Verdict:
        """The traces of `stages` (default: the first and the last), or the verdict of the one that failed."""
        made = []
        for stage in sorted({0, candidate.pp - 1}) if stages is None else stages:
            trace = traces.get(candidate, stage)
            if isinstance(trace, str):
                return Verdict(False, 0, limit, trace, MemoryPrediction(candidate, stage, 0, 0, 0, 0, 0, 0, 0, 0))
            made.append(trace)
        return made

    def floor_verdict(candidate: Candidate, floors: list[ActivationTrace]) -> Verdict:
        floors = [with_states_floor(trace, states_floor(shape, candidate)) for trace in floors]
        return fits(predict_for_shape(candidate, floors, shape, host_is_device), device_memory, usable_fraction)

    def ruled_out(
        candidate: Candidate, floors: list[ActivationTrace], why: str, untraced: str = "not traced itself"
    ) -> Verdict | None:
        """The verdict of `floors` (traces predicting at most the candidate's own) when they already do not fit
        (None: they fit; then the next bound, or the candidate's own trace, decides)."""
        verdict = floor_verdict(candidate, floors)
        if verdict.fits:
            return None
        reason = f"{verdict.reason} (at least: {why}, {untraced})"
        return dataclasses.replace(verdict, reason=reason.replace("peak ", "peak >= ", 1))

    def shallow(candidate: Candidate) -> ActivationTrace | None:
        """Stage 0 of the shallower model the candidate's trace extrapolates from, at micro-batch 1, as a floor of
        the candidate (one trace of a few layers, shared by the split's micro-batch sizes); None: not extrapolated,
        or it failed."""
        one = dataclasses.replace(candidate, micro_batch_size=1)
        if shallow_layers(shape, one) is None:
            return None
        trace = traces.shallow(one, 0)
        if isinstance(trace, str):
            return None
        return trace if candidate.micro_batch_size == 1 else floor_trace(candidate, trace)

    def shallow_floor(candidate: Candidate) -> Verdict | None:
        """Ruled out by the shallower model's first stage (`shallow`; the second trace is then never made)."""
        floor = shallow(candidate)
        why = "the bound from a shallower model's first stage at micro-batch 1"
        return None if floor is None else ruled_out(candidate, [floor], why)

    def crowded(candidate: Candidate) -> bool:
        """Whether the model states alone take half the usable memory or more: there the activations of the frugal
        split decide, and its trace is worth making; elsewhere the split's frugal layout most likely fits, and its
        trace would be wasted (an 8B search, 20 % slower with it everywhere)."""
        return floor_verdict(candidate, [states_floor(shape, candidate)]).peak_bytes * 2 >= limit

    def frugal(candidate: Candidate) -> Candidate | None:
        """The same split at micro-batch 1 with every layer checkpointed in full (its least memory); None: the
        candidate is it, or Gemini (its peak keeps no activations: no gain), or the model states leave room."""
        least = dataclasses.replace(candidate, micro_batch_size=1, checkpoint_ratio=1.0, checkpoint_mode="full")
        if least == candidate or candidate.plugin == "gemini" or not crowded(candidate):
            return None
        return least

    def split_floor(candidate: Candidate) -> Verdict | None:
        """Ruled out by the frugal split's (`frugal`) first stage of the shallower model, or its own first stage
        where that is short enough to trace as it is: one trace of a few layers, shared by every micro-batch and
        checkpointing choice of the split, so a split that cannot fit costs one such trace."""
        least = frugal(candidate)
        if least is None:
            return None
        trace = traces.shallow(least, 0)
        if isinstance(trace, str):
            return None
        depth = "of a shallower model " if shallow_layers(shape, least) is not None else ""
        why = f"the same split's first stage {depth}at micro-batch 1 with full checkpointing"
        return ruled_out(candidate, [floor_trace(candidate, trace)], why)

    def frugal_floor(candidate: Candidate) -> Verdict | None:
        """Ruled out by the first stage of the same split at micro-batch 1 with every layer checkpointed in full (its
        least memory): one trace rules out every micro-batch and checkpointing choice of a split that cannot fit.
        Only for stages deep enough to be extrapolated, whose own traces are the costly ones, and `crowded` ones."""
        frugal = dataclasses.replace(candidate, micro_batch_size=1, checkpoint_ratio=1.0, checkpoint_mode="full")
        if frugal == candidate or candidate.plugin == "gemini" or shallow_layers(shape, frugal) is None:
            return None  # (Gemini's peak keeps no activations: no gain)
        if not crowded(candidate):
            return None
        made = stage_traces(frugal, (0,))
        if isinstance(made, Verdict):
            return None
        floors = [floor_trace(candidate, made[0])]
        return ruled_out(candidate, floors, "the same split's first stage at micro-batch 1 with full checkpointing")

    def batch_floor(candidate: Candidate, smaller: tuple[int, ...]) -> Verdict | None:
        """Ruled out by the floor from the traces at the `smaller` micro-batch sizes (None: it fits, or a smaller
        trace failed; then the candidate is traced)."""
        made = [stage_traces(dataclasses.replace(candidate, micro_batch_size=size)) for size in smaller]
        if any(isinstance(stages, Verdict) for stages in made):
            return None
        stage_lists = [stages for stages in made if not isinstance(stages, Verdict)]
        floors = [floor_trace(candidate, *traces) for traces in zip(*stage_lists, strict=True)]
        sizes = " and ".join(map(str, smaller))
        return ruled_out(candidate, floors, f"the bound from the traces at micro-batch {sizes}")

    def bounded(candidate: Candidate) -> Verdict | None:
        """The first bound, cheapest first, that rules the candidate out without its own trace."""
        ruled = ruled_out(candidate, [states_floor(shape, candidate)], "the model states alone")
        ruled = ruled or split_floor(candidate) or shallow_floor(candidate) or frugal_floor(candidate)
        # Gemini's micro-batch floor keeps no activations (`floor_trace`): it adds only exact parameter counts, worth
        # it where its whole-model traces are shared (tp 1), not at tp > 1, whose would be made for it alone
        sizes = 0 if candidate.plugin == "gemini" and candidate.tp > 1 else candidate.micro_batch_size
        for smaller in ((1,), (1, 2))[: (sizes > 1) + (sizes > 2)]:
            ruled = ruled or batch_floor(candidate, smaller)
        return ruled or first_stage(candidate)

    def first_stage(candidate: Candidate) -> Verdict | None:
        """Ruled out by its own first stage, before the last is traced (the busiest stage holds at least as much)."""
        if candidate.pp == 1 or traces.has(candidate, candidate.pp - 1):
            return None
        made = stage_traces(candidate, (0,))
        if isinstance(made, Verdict):
            return made
        return ruled_out(candidate, made, "its first stage alone", "the last stage not traced")

    def judge(candidate: Candidate) -> Verdict:
        if bound and not all(traces.has(candidate, stage) for stage in {0, candidate.pp - 1}):
            ruled = bounded(candidate)
            if ruled is not None:
                return ruled
        made = stage_traces(candidate)
        if isinstance(made, Verdict):
            return made
        return fits(predict_for_shape(candidate, made, shape, host_is_device), device_memory, usable_fraction)

    return judge
