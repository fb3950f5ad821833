"""`op_counter`: the aten ops one micro-batch dispatches on a candidate's busiest pipeline stage, and its trained
parameter tensors, from the planner's FakeTensor trace of the real model under the real policy (`trace_stage`), for
the step-time model's host terms (`_host_time`).

Counts do not depend on what only moves data between ranks or sizes tensors: the data-parallel plugins (DDP, FSDP,
LowLevelZero, Gemini) run the whole model, so they share one trace per checkpointing choice; the hybrid plugins one
per split (tp, pp, sp, ep, schedule, checkpointing ratio); selective op checkpointing recomputes fewer ops than
full, so the mode is part of the key. Each is traced at micro-batch size 1 (a larger batch
dispatches the same ops: 86 and 88 for cx's GPT at 1 and 2 sequences), so a search over hundreds of candidates
traces tens of times. A candidate whose trace fails gets None (no host terms); the memory model reports the failure.

`exact=False` (the planner's choice for a GPU, where dispatch overlaps the kernels and only shows for tiny models)
traces the whole model once and gives a pipeline stage its share of the layers' ops and tensors: an 8B search over
1,466 candidates on 8 GPUs took 7.5 minutes with a trace per split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from cx_plan._candidate import Candidate
from cx_plan.step_time._host_time import OpCounts
from cx_plan.trace._model_spec import ModelShape
from cx_plan.trace._trace_cache import TraceCache, shared_trace_cache

__all__ = ["OpCounter", "op_counter"]

OpCounter = Callable[[Candidate], OpCounts | None]
_SPLITTING = ("hybrid", "moe_hybrid")


def _probe(candidate: Candidate) -> Candidate:
    """The candidate whose trace stands for `candidate`'s counts."""
    c = candidate
    if c.plugin not in _SPLITTING:
        return Candidate(
            "torch_ddp", checkpoint_ratio=c.checkpoint_ratio, checkpoint_mode=c.checkpoint_mode, precision=c.precision
        )
    return dataclasses.replace(c, micro_batch_size=1)


def _key(candidate: Candidate) -> tuple[object, ...]:
    c = candidate
    if c.plugin not in _SPLITTING:
        return ("whole model", c.checkpoint_ratio, c.checkpoint_mode, c.precision)
    skew = c.routing_skew if c.plugin == "moe_hybrid" else 1.0  # the hot rank's expert FLOPs (recompute share)
    return (c.plugin, c.tp, c.pp, c.sp, c.sp_mode, c.ep, c.checkpoint_ratio, c.pp_style, c.precision, skew)


def _count(traces: TraceCache, candidate: Candidate) -> OpCounts | None:
    probe = _probe(candidate)
    found = []
    for stage in sorted({0, probe.pp - 1}):
        trace = traces.get(probe, stage)
        if isinstance(trace, str):  # the memory model traces the same candidate and reports why
            return None
        t = trace
        found.append(OpCounts(t.forward_ops, t.backward_ops, t.parameter_tensors, t.forward_flops, t.recompute_flops))
    return max(found, key=lambda ops: (ops.forward + ops.backward, ops.parameter_tensors))


def _share(whole: OpCounts | None, shape: ModelShape, candidate: Candidate) -> OpCounts | None:
    """A pipeline stage's share of the whole model's counts (its layers over all of them)."""
    if whole is None or candidate.pp == 1:
        return whole
    chunks = candidate.num_model_chunks
    share = min(1.0, -(-shape.num_layers // (candidate.pp * chunks)) * chunks / shape.num_layers)
    return OpCounts(
        round(whole.forward * share), round(whole.backward * share), round(whole.parameter_tensors * share),
        round(whole.forward_flops * share), round(whole.recompute_flops * share),
    )  # fmt: skip


def op_counter(shape: ModelShape, seq_len: int, exact: bool = True, traces: TraceCache | None = None) -> OpCounter:
    """Counts per candidate, traced once per distinct key (see above); `exact=False`: one whole-model trace per
    checkpointing choice, shared out over pipeline stages. `traces`: the traces to share (default: this process's
    for the model, which the memory model reads too: its micro-batch-1 traces are these)."""
    cache: dict[tuple[object, ...], OpCounts | None] = {}
    shared = shared_trace_cache(shape, seq_len) if traces is None else traces

    def traced(probe: Candidate) -> OpCounts | None:
        key = _key(probe)
        if key not in cache:
            cache[key] = _count(shared, probe)
        return cache[key]

    def count(candidate: Candidate) -> OpCounts | None:
        if exact:
            return traced(candidate)
        c, ratio = candidate, candidate.checkpoint_ratio
        low = traced(Candidate("torch_ddp", precision=c.precision))
        mode = c.checkpoint_mode
        recomputing = Candidate("torch_ddp", checkpoint_ratio=1.0, checkpoint_mode=mode, precision=c.precision)
        high = traced(recomputing) if ratio else low
        if low is None or high is None:
            return None
        mixed = OpCounts(  # a ratio of the layers recomputed: between none and all
            round(low.forward + (high.forward - low.forward) * ratio),
            round(low.backward + (high.backward - low.backward) * ratio),
            low.parameter_tensors,
            low.forward_flops,
            round(low.recompute_flops + (high.recompute_flops - low.recompute_flops) * ratio),
        )
        return _share(mixed, shape, candidate)

    return count
