"""The host's share of a step: dispatching the model's aten ops, the plugin's own per-parameter work, and torch
AdamW's per-tensor loop, from counts (the trace's ops and tensors) times the device's measured costs (`_devices`).

On tiny models this is the step: a hidden-64 layer's matmuls take microseconds, dispatching one op ~12 us on this
repository's CPU. The plugin's own work per parameter tensor and step, beyond the model's forward and backward and
AdamW's loop, is the device row's measured seconds where it has them (`Device.plugin_tensor_s`, the CPU: hooks,
DTensor dispatch and Python bookkeeping cost more than their aten ops), and otherwise its aten ops (below) at the
device's per-op cost. The ops were counted (a dispatch mode, one step after warm-up) for cx's GPT and the tiny
Llama / Mixtral at hidden 64 on 1 and 2 ranks, where the per-tensor figures agreed between the models within 0.5:
- torch_ddp / torch_fsdp: 3 (gradient hooks, FSDP's shard views; DDP's bucket copies run in C++ beside);
- hybrid / moe_hybrid ZeRO 0: 0 on one data-parallel rank, 4 on more (flattening gradients into the all-reduce
  bucket and back);
- ZeRO 1/2 (low_level_zero, hybrid, moe_hybrid): 6.5 on one rank, 21 on more (the gradient bucket, the fp32 shard,
  the gathered update, per parameter);
- gemini: 8.5 on one rank, 9 on more (chunk copies in and out per parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

from cx_plan._candidate import Candidate
from cx_plan._devices import Device

__all__ = ["HostTime", "OpCounts", "host_time", "plugin_key", "plugin_ops_per_tensor", "plugin_tensor_s"]

_ZERO_PLUGINS = ("low_level_zero", "hybrid", "moe_hybrid")


@dataclass(frozen=True)
class OpCounts:
    """One micro-batch on the busiest stage: aten ops of its forward and backward, and its trained tensors; the
    forward's matmul and attention FLOPs and those activation checkpointing recomputes (0, 0: not counted)."""

    forward: int
    backward: int
    parameter_tensors: int
    forward_flops: int = 0
    recompute_flops: int = 0

    @property
    def recompute_fraction(self) -> float | None:
        """The share of the forward's FLOPs the backward runs again (None: not counted)."""
        return self.recompute_flops / self.forward_flops if self.forward_flops else None

    def __post_init__(self) -> None:
        if min(self.forward, self.backward, self.parameter_tensors, self.forward_flops, self.recompute_flops) < 0:
            raise ValueError(f"op and tensor counts must be >= 0, got {self}")


@dataclass(frozen=True)
class HostTime:
    """Seconds of host work per rank and step, oversubscription included."""

    forward_s: float  # dispatching one micro-batch's forward
    backward_s: float  # and its backward
    plugin_s: float  # the plugin's own per-parameter ops, per step
    optimizer_s: float  # AdamW's per-tensor loop, per step
    oversubscription: float  # the factor all of them (and the rank's compute) carry


def plugin_key(candidate: Candidate) -> str:
    """The plugin's row in `Device.plugin_tensor_s`: torch_ddp, torch_fsdp, zero (stage 1/2), gemini or zero0."""
    c = candidate
    if c.plugin in ("torch_ddp", "torch_fsdp", "gemini"):
        return c.plugin
    return "zero" if c.stage >= 1 else "zero0"


def plugin_tensor_s(candidate: Candidate, device: Device) -> float:
    """Seconds of the plugin's own work per parameter tensor and step on `device` (measured, else counted ops)."""
    measured = device.plugin_tensor_s.get(plugin_key(candidate))
    if measured is None:
        return plugin_ops_per_tensor(candidate) * device.op_s
    return measured[1] if candidate.dp * candidate.sp > 1 else measured[0]


def plugin_ops_per_tensor(candidate: Candidate) -> float:
    """The plugin's aten ops per parameter tensor and step, beyond the model and AdamW (the table above)."""
    c = candidate
    sharded = c.dp * c.sp > 1
    if c.plugin in ("torch_ddp", "torch_fsdp"):
        return 3.0
    if c.plugin == "gemini":
        return 9.0 if sharded else 8.5
    if c.plugin in _ZERO_PLUGINS and c.stage >= 1:
        return 21.0 if sharded else 6.5
    return 4.0 if sharded else 0.0  # hybrid / moe_hybrid ZeRO 0


def host_time(candidate: Candidate, ops: OpCounts | None, device: Device, blocks: int = 0) -> HostTime:
    """The host terms of `candidate` on `device` (all zero without counts: the caller has no trace); `blocks`: the
    decoder layers (per-block FSDP's units)."""
    slow = device.oversubscription(candidate.world_size)
    if ops is None:
        return HostTime(0.0, 0.0, 0.0, 0.0, slow)
    per_op = device.op_s * slow
    plugin = plugin_tensor_s(candidate, device) * ops.parameter_tensors * slow
    if candidate.plugin == "torch_fsdp" and candidate.fsdp_wrap == "block":  # its hooks run per unit and micro-batch
        unit = device.plugin_tensor_s.get("torch_fsdp block", (0.0, 0.0))[1 if candidate.dp > 1 else 0]
        plugin += unit * blocks * candidate.num_microbatches * slow
    optimizer = ops.parameter_tensors * device.optimizer_tensor_s * slow
    return HostTime(ops.forward * per_op, ops.backward * per_op, plugin, optimizer, slow)
