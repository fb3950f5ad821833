"""`memory_model`: the planner's one memory model. Traces each candidate's first and last pipeline stage (shared
between candidates that differ only in what a trace does not see), predicts the busiest stage and judges it with
`fits`, so `cx-plan`, `cx-train --plan` and a measurement harness read the same verdicts.

A candidate cx's own validation refuses (ValueError / NotImplementedError: a split cx cannot make of this model, say)
does not fit, with "cx refuses: <cx's message>". Any other exception during a candidate's trace is a fault of the
trace, not a verdict on the configuration: its row does not fit, with "trace failed: <type>: <message>", and the rest
of the search goes on. `PlanTraceError` (the trace cannot run in this process at all) still ends the run.
"""

from __future__ import annotations

from collections.abc import Callable

from cx_plan._candidate import Candidate
from cx_plan.memory._fits import USABLE_FRACTION, Verdict, fits
from cx_plan.memory._memory import MemoryPrediction, predict_memory_from_traces
from cx_plan.trace._activations import ActivationTrace, PlanTraceError, trace_stage
from cx_plan.trace._model_spec import ModelShape

__all__ = ["memory_model"]


def _trace_key(candidate: Candidate, stage: int) -> tuple[object, ...]:
    """What a trace sees: candidates equal here share it (ZeRO stage, dp, micro-batch count, offload are not)."""
    c = candidate
    return (c.plugin, c.tp, c.pp, c.sp, c.sp_mode, c.ep, c.micro_batch_size, c.checkpoint_ratio, c.checkpoint_mode,
            c.pp_style, c.precision, stage)  # fmt: skip


def _trace_or_reason(shape: ModelShape, candidate: Candidate, seq_len: int, stage: int) -> ActivationTrace | str:
    try:
        return trace_stage(shape, candidate, seq_len, stage)
    except PlanTraceError:
        raise
    except (ValueError, NotImplementedError) as error:
        return f"cx refuses: {error}"
    except Exception as error:  # a fault of the trace: reported in the row, the search goes on
        return f"trace failed: {type(error).__name__}: {error}"


def memory_model(
    shape: ModelShape,
    seq_len: int,
    device_memory: int,
    usable_fraction: float = USABLE_FRACTION,
    host_is_device: bool = False,
) -> Callable[[Candidate], Verdict]:
    """Trace, predict and judge each candidate against `usable_fraction` of `device_memory` bytes (`host_is_device`:
    the devices are the CPU, where offloaded optimizer states count)."""
    if device_memory <= 0:
        raise ValueError(f"device memory must be positive, got {device_memory}")
    traces: dict[tuple[object, ...], ActivationTrace | str] = {}
    limit = int(device_memory * usable_fraction)

    def judge(candidate: Candidate) -> Verdict:
        made = []
        for stage in sorted({0, candidate.pp - 1}):
            key = _trace_key(candidate, stage)
            if key not in traces:
                traces[key] = _trace_or_reason(shape, candidate, seq_len, stage)
            trace = traces[key]
            if isinstance(trace, str):
                return Verdict(False, 0, limit, trace, MemoryPrediction(candidate, stage, 0, 0, 0, 0, 0, 0, 0, 0))
            made.append(trace)
        prediction = predict_memory_from_traces(candidate, made, shape.parameters, host_is_device)
        return fits(prediction, device_memory, usable_fraction)

    return judge
