"""`states_floor`: a lower bound of the parameters one pipeline stage of a candidate trains, from the model's
parameter counts alone (no trace), as an `ActivationTrace` with no activations, so the memory model can rule out a
layout whose model states alone exceed the device before tracing it (ZeRO 0 over a 47B MoE, say).

Every figure only undercounts: the stage holds at least floor(layers / slots) layers per model chunk, each at least
the smallest layer of the model; tensor parallelism splits at most all of a layer's parameters (norms stay whole),
expert parallelism at most all of its routed experts; the embeddings and the head count only when one stage holds
the whole model, and a pipeline's first stage its token embedding (its first chunk is the model's first). The
prediction is a sum of non-negative terms in these counts, so it undercounts too.
"""

from __future__ import annotations

import dataclasses

from cx_plan._candidate import Candidate
from cx_plan.trace._activations import ActivationTrace
from cx_plan.trace._model_spec import ModelShape

__all__ = ["states_floor", "with_states_floor"]

_ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2}


def states_floor(shape: ModelShape, candidate: Candidate) -> ActivationTrace:
    """Pipeline stage 0's floor: trained parameters (and of them routed experts) at most what it really trains."""
    counts, c = shape.parameters, candidate
    slots = c.pp * c.num_model_chunks
    layers = shape.num_layers // slots * c.num_model_chunks
    dense = min(counts.dense_per_layer, default=0) * layers // c.tp
    experts = min(counts.experts_per_layer, default=0) * layers // (c.tp * c.ep)
    outer = counts.outer // c.tp if c.pp == 1 else _token_embedding(shape) // c.tp
    n = dense + experts + outer
    w = _ITEMSIZE[c.precision]
    return ActivationTrace(0, w * n, 0, 0, 0, w * n, 0, n, experts)


def _token_embedding(shape: ModelShape) -> int:
    """The token embedding's elements, which pipeline stage 0 holds (its first chunk is the model's first): vocab x
    hidden, at most the embeddings counted less an untied LM head (a model without such a table gets less)."""
    table = shape.vocab_size * shape.hidden_size
    counts = shape.parameters
    return max(0, min(table, counts.embeddings - (0 if counts.tied else table)))


def with_states_floor(trace: ActivationTrace, floor: ActivationTrace) -> ActivationTrace:
    """`trace` (itself a floor, e.g. of a shallower model) with at least the parameters of `floor`."""
    return dataclasses.replace(
        trace,
        parameter_bytes=max(trace.parameter_bytes, floor.parameter_bytes),
        parameter_count=max(trace.parameter_count, floor.parameter_count),
        expert_parameter_count=max(trace.expert_parameter_count, floor.expert_parameter_count),
    )
