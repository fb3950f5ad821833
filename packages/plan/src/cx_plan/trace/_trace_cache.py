"""`TraceCache`: one model's FakeTensor traces, each made once and shared by every candidate (and by the memory
model and the op counter) that runs the same thing on the stage traced.

What a trace sees: the data-parallel plugins (DDP, FSDP, LowLevelZero, Gemini) run the whole model as it is, so their
key is only the micro-batch, the checkpointing and the precision: one trace serves all four plugins, every dp size and
ZeRO stage. The hybrid plugins' key is their split (tp, pp, sp, ep, schedule), the micro-batch and the checkpointing
ratio, and MoeHybrid's the routing skew too (the hot rank's dispatch sizes); ZeRO stage, dp and the micro-batch count
are not part of it. `shared_trace_cache` keeps one cache per model and sequence length for the process, so
`cx-train --plan` and repeated plans of one model trace once. A deep stage's trace is extrapolated from two shallower
ones (`trace_stage`); the first of them is kept too (`shallow`), as the memory model's floor before the second. The
per-layer slope the second gives is shared by every stage of every pp > 1 split that is otherwise the same and holds
the same ends of the model (`slope_key`, `stage_role`: first, last, both or neither; stages of different roles differ,
e.g. Llama 3.1 8B at full checkpointing), so a pipelined split costs one shallow trace per stage and one deeper trace
per role.

A trace cx's validation refuses (ValueError / NotImplementedError) is kept as "cx refuses: <message>", any other
fault as "trace failed: <type>: <message>"; `PlanTraceError` (no trace can run in this process) is raised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from cx_plan._candidate import Candidate
from cx_plan.trace._activations import (
    ActivationTrace,
    LayerSlope,
    PlanTraceError,
    layer_slope,
    shallow_layers,
    trace_shallow,
    trace_stage,
)
from cx_plan.trace._model_spec import ModelShape

__all__ = ["TraceCache", "shared_trace_cache", "slope_key", "trace_key"]

_SPLITTING = ("hybrid", "moe_hybrid")
_Made = TypeVar("_Made", ActivationTrace, LayerSlope)
_KEPT_MODELS = 4  # models whose traces a process keeps (a planner session rarely plans more)


def trace_key(candidate: Candidate, stage: int) -> tuple[object, ...]:
    """What a trace of `candidate`'s `stage` depends on: candidates equal here share it."""
    c = candidate
    if c.plugin not in _SPLITTING:
        # Gemini at tp > 1 traces a tp rank's ShardFormer split: the tp size is part of what it sees
        return ("whole model", c.tp, c.micro_batch_size, c.checkpoint_ratio, c.checkpoint_mode, c.precision)
    return (c.plugin, c.tp, c.pp, c.sp, c.sp_mode, c.ep, c.micro_batch_size, c.checkpoint_ratio, c.checkpoint_mode,
            c.pp_style, c.precision, stage, c.routing_skew if c.plugin == "moe_hybrid" else 1.0)  # fmt: skip


def slope_key(candidate: Candidate, stage: int) -> tuple[object, ...]:
    """What the per-layer slope of `candidate`'s `stage` depends on: its trace key less the pipeline size and stage
    (only whether there is a pipeline: a pp 1 stage holds the loss and the embedding in one). A checkpoint ratio
    strictly between 0 and 1 checkpoints a share of each stage's layers, so the stage's depth changes which layers
    recompute: there the key stays the stage's own."""
    c = candidate
    if c.plugin not in _SPLITTING or 0 < c.checkpoint_ratio < 1:
        return ("slope", *trace_key(candidate, stage))
    skew = c.routing_skew if c.plugin == "moe_hybrid" else 1.0
    return ("slope", c.plugin, c.tp, c.pp > 1, c.sp, c.sp_mode, c.ep, c.micro_batch_size, c.checkpoint_ratio,
            c.checkpoint_mode, c.pp_style, c.precision, skew, stage_role(c, stage))  # fmt: skip


def stage_role(candidate: Candidate, stage: int) -> tuple[bool, bool]:
    """Whether `stage` holds the input side (embedding) and the output side (head, loss): the stage's peak is made of
    different things with and without them, so what a layer adds differs too (Llama 3.1 8B, full checkpointing, pp 2:
    the last stage's and a zero-bubble V's middle stage's slopes are not the first stage's). Zero-bubble V puts both
    ends on stage 0."""
    c = candidate
    if c.pp_style == "zbv":
        return stage == 0, stage == 0
    return stage == 0, stage == c.pp - 1


class TraceCache:
    """The traces of one model at one sequence length; `made` counts the traces run (not the ones served again)."""

    def __init__(self, shape: ModelShape, seq_len: int) -> None:
        self.shape, self.seq_len = shape, seq_len
        self.made = 0
        self._traces: dict[tuple[object, ...], ActivationTrace | str] = {}
        self._slopes: dict[tuple[object, ...], LayerSlope | str] = {}

    def has(self, candidate: Candidate, stage: int) -> bool:
        return trace_key(candidate, stage) in self._traces

    def get(self, candidate: Candidate, stage: int) -> ActivationTrace | str:
        """The stage's trace, or the reason it could not be made (see the module docstring)."""
        key = trace_key(candidate, stage)
        if key not in self._traces:
            self._traces[key] = self._stage(candidate, stage)
        return self._traces[key]

    def _stage(self, candidate: Candidate, stage: int) -> ActivationTrace | str:
        if shallow_layers(self.shape, candidate) is None:
            return self._made(lambda: trace_stage(self.shape, candidate, self.seq_len, stage))
        shallow = self.shallow(candidate, stage)
        if isinstance(shallow, str):
            return shallow
        key = slope_key(candidate, stage)
        if key not in self._slopes:
            self._slopes[key] = self._made(lambda: layer_slope(self.shape, candidate, self.seq_len, stage, shallow))
        slope = self._slopes[key]
        if isinstance(slope, str):
            return slope
        return trace_stage(self.shape, candidate, self.seq_len, stage, shallow=shallow, slope=slope)

    def shallow(self, candidate: Candidate, stage: int) -> ActivationTrace | str:
        """The stage of the shallower model `trace_stage` extrapolates from (`trace_shallow`: a floor of every
        figure of the stage, one trace of a few layers); the stage's own trace when it is not extrapolated."""
        if shallow_layers(self.shape, candidate) is None:
            return self.get(candidate, stage)
        key = ("shallow", *trace_key(candidate, stage))
        if key not in self._traces:
            self._traces[key] = self._made(lambda: trace_shallow(self.shape, candidate, self.seq_len, stage))
        return self._traces[key]

    def _made(self, trace: Callable[[], _Made]) -> _Made | str:
        self.made += 1
        try:
            return trace()
        except PlanTraceError:
            raise
        except (ValueError, NotImplementedError) as error:
            return f"cx refuses: {error}"
        except Exception as error:  # a fault of the trace: reported in the row, the search goes on
            return f"trace failed: {type(error).__name__}: {error}"


_CACHES: list[TraceCache] = []


def shared_trace_cache(shape: ModelShape, seq_len: int) -> TraceCache:
    """This process's cache for `shape` (the same object) at `seq_len`; the oldest of more than a few is dropped."""
    for cache in _CACHES:
        if cache.shape is shape and cache.seq_len == seq_len:
            return cache
    cache = TraceCache(shape, seq_len)
    _CACHES.append(cache)
    del _CACHES[:-_KEPT_MODELS]
    return cache
