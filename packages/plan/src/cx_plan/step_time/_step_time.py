"""Step time of a `Candidate`: FLOPs at an assumed fraction of the device's peak, the collectives over the links
they cross, the pipeline schedule simulated with those costs, and the optimizer step at memory bandwidth.

- FLOPs per token (PaLM, appendix B): 6 x the matmul parameters a token passes through (every decoder parameter
  outside the routed experts, top_k / experts of theirs, and the LM head; the input embedding is a lookup) plus
  12 x layers x seq_len x attention width for the attention scores and their values (no causal halving).
  Activation checkpointing recomputes what the trace saw it rerun (`OpCounts.recompute_fraction`: the matmul and
  attention FLOPs the backward runs again, as a share of the forward's): full checkpointing reruns the layers'
  forward, the selective op policy only the matmuls it did not save (never attention), so it costs less. Without
  a trace: the layers' forward x `checkpoint_ratio` (full), half their matmul FLOPs (selective op).
- Compute runs at `efficiency` x peak (default: the device row's `Device.efficiency`, fitted to one published run
  for `a100` and `h100_96gb`, `ACHIEVABLE_FRACTION` (45 %) elsewhere; on this repository's CPU the peak is a
  measured matmul rate, see `_devices`). Every rank does 1/world of the FLOPs
  (the layers split evenly over pp, the experts balanced over ep), except under routing skew (`routing_skew` > 1
  with ep > 1): the hottest ep rank computes `hot_rank_load` x its balanced share of the routed experts' FLOPs and
  the slowest rank sets the step, so its expert compute (and its dispatch / combine all-to-all, `_comm_volume`) is
  charged.
- `kernels` (`_kernels.Kernels`, default eager): with fp8 the decoder layers' linear FLOPs (`linear_flops_per_token`)
  run at `fp8_gain` x `efficiency` x the device's bf16 peak instead (at most `efficiency` x its fp8 peak);
  torch.compile divides the forward and backward compute by `compile_speedup` (both fitted to torchtitan's
  published Llama 3.1 8B runs, see `_kernels`). The recompute takes the forward's mix. MFU stays against the
  precision's peak (torchtitan reports none with fp8 for that reason).
- A collective takes hops x latency + bytes / bandwidth on the slowest link its group crosses (`_comm_volume`); a
  ring collective (all-reduce, all-gather, reduce-scatter) across nodes at the summed inter links of the group's
  ranks on the node holding fewest of them, at most the intra link (`Network.ring_bandwidth`: NCCL spreads its
  rings over a node's NICs).
- Overlap (`_hidden_data_parallel`), on a device that launches asynchronously (a GPU: NCCL runs on its own stream;
  on the host-bound CPU every collective adds, as calibrated), the data-parallel communication a plugin issues
  during compute hides under that compute, except what cannot start before the compute ends or must finish before
  it starts: per-block FSDP prefetches the next unit's all-gather and reduce-scatters a unit's gradients while the
  backward goes on, so its gathers and reduce-scatters hide under all micro-batches' forward and backward, less one
  unit's share (the first gather, the last reduce-scatter: units = layers + the root); DDP's gradient buckets and
  LowLevelZero's (overlap_communication, its default) reduce-scatter buckets hide under the last micro-batch's
  backward (the others run under no_sync), less the last bucket; LowLevelZero's weight all-gather after the step,
  FSDP under one root unit, Gemini and the hybrid plugins' data-parallel collectives are not overlapped. The
  hidden seconds are `StepTime.hidden_s`; what is hidden can never exceed the compute it hides under.
- pp > 1: each micro-batch's forward and backward per model chunk, with its tp / sp / expert collectives and its p2p
  transfer, is one action of cx-pipeline's schedule (`schedule_orders`), and `simulate` gives the makespan; the
  bubble is the makespan minus the busiest stage's work. ZB-V splits each backward into equal I and W halves.
- The optimizer step streams 28 bytes per fp32 master parameter (read weight, gradient, two moments; write weight
  and moments), plus the 16-bit weight copy, at the device's memory bandwidth; offloaded optimizer state crosses PCIe
  5 (gradients down, weights up) and steps at `HOST_BANDWIDTH`.
- Optimizer muon (MuonWithAdamW): the rank steps what it owns (`_muon_split.stepped_load`: all it holds, or its
  owner share of the whole parameters where the plugin shards them, plus its AdamW shards under LowLevelZero;
  moe_hybrid at tp > 1: and all its routed experts), streaming 20 bytes per Muon element (read weight, gradient,
  momentum; write weight and momentum) and AdamW's 28 per other element, plus Newton-Schulz's FLOPs (5 iterations of
  4 m^2 n + 2 m^3 per m x n matrix, m <= n) at `efficiency` x the bf16 peak (torch runs Newton-Schulz in bf16), or
  at `HOST_FLOPS` where the owners' whole masters are on the CPU (`muon_on_host`: cpu_offload, Gemini with CPU
  optimizer data), the host's rate unless the device is the CPU; the gather / scatter to owners is in
  `_comm_volume`.
- Host work (`_host_time`, given the trace's op and tensor counts): dispatching each micro-batch's aten ops, the
  plugin's own per-parameter ops and AdamW's per-tensor loop, at the device's measured per-op and per-tensor costs.
  On a host-bound device (the CPU) they add to the compute, and with more ranks than cores every rank's host work,
  compute and collective latency run world / cores slower; on a GPU the host launches asynchronously, so dispatch
  only counts where it exceeds the kernels it launches (per micro-batch forward and backward; the plugin's and the
  optimizer's ops against the optimizer step).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from cx_pipeline import Action, ActionKind, schedule_orders, simulate
from cx_plan._candidate import Candidate
from cx_plan._devices import ACHIEVABLE_FRACTION, LINKS, Device, Network, default_network
from cx_plan.step_time._comm_volume import BUCKET_BYTES, Collective, step_collectives, weight_bytes
from cx_plan.step_time._host_time import OpCounts, host_time
from cx_plan.step_time._kernels import EAGER, Kernels
from cx_plan.trace._model_spec import ModelShape
from cx_plan.trace._muon_split import muon_on_host, stepped_load
from cx_plan.trace._oracle import hot_rank_load

__all__ = [
    "ACHIEVABLE_FRACTION",
    "HOST_BANDWIDTH",
    "HOST_FLOPS",
    "StepTime",
    "flops_per_token",
    "linear_flops_per_token",
    "predict_step_time",
    "worst_rank_expert_flops",
]

HOST_BANDWIDTH = 100e9  # bytes/s a CPU Adam streams on a GPU server's host (a share of its ~300 GB/s DRAM)
# FLOP/s a GPU server's host reaches on Newton-Schulz's bf16 matmuls (assumed: a share of a two-socket server's
# AVX-512 / AMX cores beside the ranks' other host work, an order of magnitude under a GPU's achieved rate)
HOST_FLOPS = 2e12
_ADAM_BYTES = 28  # per fp32 master parameter and step: read w, g, m, v (16), write w, m, v (12)
_MUON_BYTES = 20  # per Muon element: read w, g, momentum (12), write w, momentum (8)


@dataclass(frozen=True)
class StepTime:
    """One optimizer step of one candidate, per rank; seconds unless named otherwise."""

    flops_per_token: float  # model FLOPs (no recompute)
    tokens_per_step: int  # all ranks
    compute_s: float  # the rank's forward + backward at the achievable rate, recompute included
    recompute_s: float
    bubble_s: float  # pipeline idle time on the busiest stage
    communication_s: dict[str, float] = field(default_factory=dict)  # by collective, as run (not overlapped)
    optimizer_s: float = 0.0
    step_s: float = 0.0
    world_size: int = 1
    peak_flops: float = 0.0  # one device's, for MFU
    dispatch_s: float = 0.0  # host time dispatching the model's aten ops, all micro-batches (hidden on a GPU where
    # the kernels take longer)
    plugin_s: float = 0.0  # the plugin's own per-parameter ops
    optimizer_overhead_s: float = 0.0  # AdamW's per-tensor loop, beside `optimizer_s` (its bytes)
    oversubscription: float = 1.0  # how much slower ranks sharing too few cores run (in every term above)
    hidden_s: float = 0.0  # data-parallel communication hidden under compute (the overlap rule), not in step_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs per second over the world's peak (recompute not counted)."""
        return self.tokens_per_s * self.flops_per_token / (self.world_size * self.peak_flops)


def flops_per_token(shape: ModelShape, seq_len: int) -> tuple[float, float]:
    """(training FLOPs per token, the decoder layers' share of them): 6 x active matmul parameters + attention."""
    counts = shape.parameters
    routed = counts.experts * shape.top_k / shape.num_experts if shape.num_experts else 0.0
    layers = sum(counts.dense_per_layer) + routed
    head = shape.vocab_size * shape.hidden_size
    attention = 12.0 * shape.num_layers * seq_len * shape.num_heads * shape.head_dim
    in_layers = 6.0 * layers + attention
    return in_layers + 6.0 * head, in_layers


def worst_rank_expert_flops(candidate: Candidate, shape: ModelShape) -> float:
    """Training FLOPs per token the hottest ep rank runs above the balanced share (0 without skew or ep)."""
    if not shape.num_experts:
        return 0.0
    load = hot_rank_load(candidate.routing_skew, candidate.ep, shape.num_experts, shape.top_k)
    routed = shape.parameters.experts * shape.top_k / shape.num_experts
    return 6.0 * routed * (load - 1.0)


def linear_flops_per_token(candidate: Candidate, shape: ModelShape) -> float:
    """Training FLOPs per token of the decoder layers' linear layers on the busiest rank's share (what fp8 runs):
    6 x their matmul parameters (the routed experts' top_k share, the hottest ep rank's excess included); not
    attention's scores and values, not the output head."""
    counts = shape.parameters
    routed = counts.experts * shape.top_k / shape.num_experts if shape.num_experts else 0.0
    return 6.0 * (sum(counts.dense_per_layer) + routed) + worst_rank_expert_flops(candidate, shape)


def _seconds_per_token(
    candidate: Candidate, shape: ModelShape, seq_len: int, device: Device, efficiency: float, kernels: Kernels
) -> float:
    """Compute seconds per token of the whole world's forward and backward on one device (no recompute): every FLOP
    at `efficiency` x the precision's peak, or with fp8 the layers' linear FLOPs at `fp8_gain` x `efficiency` x the
    bf16 peak (at most `efficiency` x the fp8 peak); then torch.compile's factor on all of it."""
    per_token = flops_per_token(shape, seq_len)[0] + worst_rank_expert_flops(candidate, shape)
    seconds = per_token / (device.peak(candidate.precision) * efficiency)
    if kernels.fp8_gain is not None:
        linear = linear_flops_per_token(candidate, shape)
        fp8_rate = efficiency * min(device.peak("bf16") * kernels.fp8_gain, device.peak("fp8"))
        seconds += linear / fp8_rate - linear / (device.peak(candidate.precision) * efficiency)
    return seconds / kernels.compile_speedup


def _seconds(collective: Collective, network: Network, slow: float = 1.0) -> float:
    """Hops at the link's latency (`slow` x: a peer waiting for its core) plus the bytes at its bandwidth (a ring
    collective's across nodes: the NICs of the group's ranks on a node together, `Network.ring_bandwidth`)."""
    link = network.link_for(collective.span)
    c = collective
    bandwidth = network.ring_bandwidth(c.axes, c.world) if c.ring else link.bandwidth
    return c.hops * link.latency * slow + c.bytes / bandwidth


def _optimizer_seconds(candidate: Candidate, shape: ModelShape, device: Device) -> float:
    c, counts = candidate, shape.parameters
    dense_dp = c.dp * c.sp if c.stage >= 1 else 1
    expert_dp = c.moe_dp if c.stage >= 1 else 1
    held = counts.dense / (c.tp * c.pp) / dense_dp + counts.experts / (c.ep * c.pp) / expert_dp
    w = weight_bytes(c)
    per_parameter: float = _ADAM_BYTES + (w if w == 2 else 0)
    if c.muon:  # what this rank steps (its owner share, or all it holds), Muon's elements at 20 bytes
        load = stepped_load(c, shape)
        held = load.elements + load.sharded_elements  # whole parameters it owns, AdamW shards under LowLevelZero
        if held:
            per_parameter -= (_ADAM_BYTES - _MUON_BYTES) * load.muon_elements / held
    offloaded = c.offload_optim_frac if c.plugin == "gemini" else (1.0 if c.cpu_offload else 0.0)
    on_device = held * (1 - offloaded) * per_parameter / device.memory_bandwidth
    if not offloaded or device.name == "cpu":
        return on_device + (held * offloaded * per_parameter / device.memory_bandwidth)
    pcie = LINKS["pcie5"].bandwidth
    return on_device + held * offloaded * ((4 + w) / pcie + _ADAM_BYTES / HOST_BANDWIDTH)


def _recompute_fraction(candidate: Candidate, shape: ModelShape, seq_len: int, ops: OpCounts | None) -> float:
    """The share of the forward's FLOPs activation checkpointing runs again in the backward (module docstring)."""
    c = candidate
    if not c.checkpoint_ratio:
        return 0.0
    traced = None if ops is None else ops.recompute_fraction
    if traced is not None:
        return traced
    per_token, in_layers = flops_per_token(shape, seq_len)
    if c.checkpoint_mode == "selective-op":
        attention = 12.0 * shape.num_layers * seq_len * shape.num_heads * shape.head_dim
        return (in_layers - attention) / 2 / per_token * c.checkpoint_ratio
    return in_layers / per_token * c.checkpoint_ratio


def _hidden_data_parallel(
    candidate: Candidate, shape: ModelShape, times: dict[str, float], forward: float, backward: float, device: Device
) -> float:
    """Seconds of the data-parallel collectives `times` hidden under the compute of the plugin's overlap window
    (`forward` / `backward`: one micro-batch's); the rule is the module docstring's."""
    c = candidate
    if device.host_bound or c.pp > 1:
        return 0.0
    gradients = sum(t for name, t in times.items() if "gradient" in name and not name.startswith("muon "))
    gathers = sum(t for name, t in times.items() if "weight all-gather" in name)
    if c.plugin == "torch_fsdp" and c.fsdp_wrap == "block":
        units = shape.num_layers + 1
        movable = (gradients + gathers) * (1 - 1 / units)
        window = c.num_microbatches * (forward + backward)
    elif c.plugin == "torch_ddp" or (c.plugin == "low_level_zero" and c.stage >= 1):
        buckets = max(1, math.ceil(shape.parameters.total * weight_bytes(c) / BUCKET_BYTES))
        movable = gradients * (1 - 1 / buckets)
        window = backward
    else:
        return 0.0
    return min(movable, window)


def _with_host(device_s: float, host_s: float, host_bound: bool) -> float:
    """Work the host dispatches beside the device's: added on a host-bound device, overlapped on an asynchronous one."""
    return device_s + host_s if host_bound else max(device_s, host_s)


@functools.lru_cache(maxsize=4096)
def _pipeline_makespan(
    style: str, pp: int, microbatches: int, chunks: int, forward: float, backward: float, hop: float
) -> tuple[float, float]:
    """(makespan, busiest stage's work) of one step with per-chunk, per-micro-batch action costs (cached: the
    candidates that differ only in ZeRO stage or offload share it)."""
    orders, virtual = schedule_orders(style, pp, microbatches, chunks)
    f, b = forward / chunks, backward / chunks

    def cost(action: Action) -> float:
        if action.kind is ActionKind.FORWARD:
            return f + hop
        if action.kind is ActionKind.BACKWARD:
            return b + hop
        return b / 2 + (hop if action.kind is ActionKind.BACKWARD_INPUT else 0.0)

    result = simulate(orders, virtual, cost)
    return result.makespan, max(result.busy)


def predict_step_time(
    candidate: Candidate,
    shape: ModelShape,
    seq_len: int,
    device: Device,
    network: Network | None = None,
    efficiency: float | None = None,
    ops: OpCounts | None = None,
    kernels: Kernels = EAGER,
) -> StepTime:
    """The predicted time of one optimizer step of `candidate` (global batch `candidate.global_batch_size`
    sequences of `seq_len` tokens) on `world_size` devices of `device` connected by `network`; `ops` (the trace's
    counts for the candidate's busiest stage) adds the host's time, None leaves it out; `kernels`: torch.compile's
    factor and fp8 linear layers (`_kernels`); `efficiency`: the achievable fraction of peak (None: the device
    row's, `Device.efficiency`)."""
    efficiency = device.efficiency if efficiency is None else efficiency
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency (the achievable fraction of peak) must be in (0, 1], got {efficiency}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if efficiency * kernels.compile_speedup > 1:
        raise ValueError(
            f"efficiency {efficiency:g} x compile_speedup {kernels.compile_speedup:g} is above the device's peak"
        )
    c = candidate
    net = default_network(device) if network is None else network
    host = host_time(c, ops, device, shape.num_layers)
    slow = host.oversubscription
    peak = device.peak(c.precision)
    per_token, _ = flops_per_token(shape, seq_len)
    tokens = c.global_batch_size * seq_len
    per_token_s = _seconds_per_token(c, shape, seq_len, device, efficiency, kernels)
    model_s = tokens * per_token_s * slow / c.world_size  # ranks sharing cores share their FLOPs
    recompute_s = model_s / 3 * _recompute_fraction(c, shape, seq_len, ops)
    collectives = step_collectives(c, shape, seq_len)
    times = {col.name: _seconds(col, net, slow) for col in collectives}
    in_layer = sum(times[col.name] for col in collectives if col.name.startswith(("tp ", "sp ", "expert ")))
    data_parallel = sum(t for name, t in times.items() if "gradient" in name or "weight" in name)  # muon's too
    optimizer_s = _optimizer_seconds(c, shape, device) * slow
    if c.muon:  # Newton-Schulz on the matrices this rank steps, in bf16: on the host where its masters are
        on_host = muon_on_host(c) and device.name != "cpu"
        rate = HOST_FLOPS if on_host else device.peak("bf16") * efficiency
        optimizer_s += stepped_load(c, shape).ns_flops / rate * slow
    passes = 2 + c.checkpoint_ratio
    m = c.num_microbatches
    bound = device.host_bound
    forward = _with_host(model_s / 3 / m, host.forward_s, bound) + in_layer / passes / m
    backward = _with_host((2 * model_s / 3 + recompute_s) / m, host.backward_s, bound)
    backward += in_layer * (1 + c.checkpoint_ratio) / passes / m
    optimizer_step = _with_host(optimizer_s, host.plugin_s + host.optimizer_s, bound)
    bubble_s = 0.0
    if c.pp > 1:
        p2p = next(col for col in collectives if col.pipelined)
        hop = _seconds(p2p, net, slow) / p2p.hops
        makespan, busiest = _pipeline_makespan(c.pp_style, c.pp, m, c.num_model_chunks, forward, backward, hop)
        bubble_s = makespan - busiest
        times[p2p.name] = busiest - m * (forward + backward)
        body = makespan
    else:
        body = m * (forward + backward)
    hidden_s = _hidden_data_parallel(c, shape, times, forward, backward, device)
    step_s = body + data_parallel - hidden_s + optimizer_step
    return StepTime(
        flops_per_token=per_token,
        tokens_per_step=tokens,
        compute_s=model_s + recompute_s,
        recompute_s=recompute_s,
        bubble_s=bubble_s,
        communication_s=times,
        optimizer_s=optimizer_s,
        step_s=step_s,
        world_size=c.world_size,
        peak_flops=peak,
        dispatch_s=m * (host.forward_s + host.backward_s),
        plugin_s=host.plugin_s,
        optimizer_overhead_s=host.optimizer_s,
        oversubscription=slow,
        hidden_s=hidden_s,
    )
