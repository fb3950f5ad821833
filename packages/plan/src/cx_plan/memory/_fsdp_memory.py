"""TorchFSDPPlugin's (FSDP2's) bytes per rank, for one root unit (`fsdp_wrap="model"`) or one unit per decoder layer
(`"block"`, what torchtitan and cx-train run).

Between steps a rank holds its fp32 shard of the parameters and AdamW's two moments (1/dp each); `zero_grad` frees
the sharded gradients. Three instants compete for the peak:
- the backward's start: cx (like torchtitan) passes `reshard_after_forward=True` to the root too, so the root unit
  (the whole model, or per block its own parameters: embeddings, final norm, LM head) is gathered again when the
  backward reaches it, with the forward's saved activations live: FSDP2's all-gather output and the unsharded
  parameters it is copied into exist together;
- inside the backward, at the trace's peak (where the activations are largest): the activations, the unsharded
  gradients live then (in the compute precision, MixedPrecisionPolicy's param_dtype) and the gathered parameters:
  the whole model under one root unit; per block, the root unit's plus the two largest blocks (the running one and
  the one prefetched);
- at a unit's reduce-scatter, late in the backward: FSDP2 has resharded the unit's parameters already; its unsharded
  gradients and their packed copy in the reduce dtype (fp32), then that copy and this rank's reduced shard, beside
  the shards of the units already reduced. For one root unit that is the whole model at once; per block it is the
  root unit, reduced last.
The first and the last go into `end_of_backward` (the larger of the two); each was found by a measured miss
(benchmarks/plan/notes.md). CPU devices count the same: cx's TorchFSDPPlugin reduces in place on gloo as NCCL does
(`cx_plugins.fsdp._gloo_comms`; gloo's own reduce-scatter copies its whole input and frees that copy whenever its
worker thread gets to it).
Gradient accumulation runs the earlier micro-batches under `no_sync` (FSDP2's `set_requires_gradient_sync(False)`,
what cx-train and `booster.no_sync` do): every unit keeps its unsharded gradient, summed in fp32 (the reduce dtype),
until the last micro-batch's backward reduce-scatters it, so all three instants of that backward hold it too.
With one rank nothing is gathered (the shard is the parameter); the whole fp32 gradient is counted beside the
activations instead, as for DDP without its buckets (measured within 3 % for one root unit, 5-10 % over per block).
"""

from __future__ import annotations

from dataclasses import dataclass

from cx_plan._candidate import Candidate
from cx_plan.trace._activations import ActivationTrace
from cx_plan.trace._model_spec import ParameterCounts

__all__ = ["FSDPBytes", "fsdp_bytes"]

_FP32 = 4
_ADAM_MOMENTS = 2


@dataclass(frozen=True)
class FSDPBytes:
    parameters: int  # this rank's fp32 shard
    gradients: int  # unsharded gradients live at the backward's peak
    activations: int  # the activations at that peak
    optimizer_states: int
    gathered: int  # unsharded parameters at the backward's peak (comm buffers)
    end_of_backward: int  # the backward's start or the last unit's reduce-scatter, the larger (0: one rank)


def _units(c: Candidate, n: int, counts: ParameterCounts | None) -> tuple[int, int, int]:
    """(parameters gathered at the backward's peak, parameters of the root unit: re-gathered when the backward
    starts, reduce-scattered last; the largest unit besides it, whose unsharded gradients wait beside the root's)."""
    if c.fsdp_wrap == "model":
        return n, n, 0
    if counts is None:
        raise ValueError("per-block FSDP needs the model's parameter counts (outer and per layer)")
    pairs = zip(counts.dense_per_layer, counts.experts_per_layer, strict=True)
    layers = sorted((dense + experts for dense, experts in pairs), reverse=True)
    outer = max(n - sum(layers), 0)  # embeddings, final norm, LM head (as the trace counts them)
    return outer + sum(layers[:2]), outer, layers[0] if layers else 0


def fsdp_bytes(c: Candidate, trace: ActivationTrace, counts: ParameterCounts | None) -> FSDPBytes:
    """Bytes of the trace's `parameter_count` trained parameters under `c` (torch_fsdp). The trace runs the model
    unsharded, so its gradients pile up as the backward goes; per block FSDP holds only the root unit's and one
    block's unsharded, so where the trace's peak is theirs (a 70B model's gradients outweigh its activations) the
    peak is taken with those and the larger of the peak's and the forward's saved activations."""
    w = 2 if c.half_precision else _FP32
    n, dp, saved_bytes = trace.parameter_count, c.dp, trace.saved_bytes
    shard, optimizer = _FP32 * n // dp, _ADAM_MOMENTS * _FP32 * n // dp
    gathered, last_unit, largest = _units(c, n, counts)
    live, activations = trace.gradient_bytes, trace.activation_bytes
    if c.fsdp_wrap == "block" and live > w * (last_unit + largest):
        live, activations = w * (last_unit + largest), max(activations, saved_bytes)
    accumulated = _FP32 * n if c.num_microbatches > 1 else 0  # no_sync: the earlier micro-batches' gradients
    if dp == 1:  # measured as DDP without buckets: the shard is the parameter, an fp32 gradient beside it
        return FSDPBytes(shard, live + _FP32 * n + accumulated, activations, optimizer, 0, 0)
    live += accumulated
    regather = shard + optimizer + saved_bytes + accumulated + 2 * w * last_unit  # all-gather output + unsharded
    reduced_before = _FP32 * (n - last_unit) // dp  # the other units' reduced gradient shards
    # FSDP2's post_backward reshards the unit first, then copies its gradients into the packed fp32 input, drops them,
    # and only then allocates this rank's output: the gradients or the output beside the input, never all three
    output = _FP32 * last_unit // dp
    unit_gradient = (_FP32 if accumulated else w) * last_unit  # summed in fp32 under no_sync
    packed = _FP32 * last_unit + max(unit_gradient, output)
    reduce = shard + optimizer + reduced_before + packed
    return FSDPBytes(shard, live, activations, optimizer, w * gathered, max(regather, reduce))
