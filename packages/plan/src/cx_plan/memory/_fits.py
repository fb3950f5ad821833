"""Fits / does not fit: a `MemoryPrediction` against the device's memory, with the reason naming the component
that overflows and what to try.

A prediction fits when its peak is at most `usable_fraction` of the device (allocator fragmentation, CUDA context and
library workspaces take the rest, the reserve; 0.9 by default, stated in the report). A peak inside the reserve (above
the usable part, within the device's memory) still fits, as "tight": whether it runs depends on what the reserve is
really used for, which the planner does not know (torchtitan's Llama 3.1 8B run peaks at 73 GiB of an H100's 79.6).
"""

from __future__ import annotations

from dataclasses import dataclass

from cx_plan.memory._memory import MemoryPrediction

__all__ = ["USABLE_FRACTION", "Verdict", "fits", "format_bytes"]

USABLE_FRACTION = 0.9

_SUGGESTIONS = {
    "activations": "activation checkpointing (checkpoint_ratio 1.0), a smaller micro-batch, or more tp / sp",
    "pipeline_inflight": "fewer pipeline stages or the 1f1b schedule; a smaller micro-batch",
    "optimizer_states": "ZeRO (zero_stage 1 or 2, Gemini or FSDP) over more data-parallel ranks, or CPU offload",
    "master_weights": "ZeRO stage 1+ to shard the fp32 master weights, or Gemini's offload_param_frac",
    "parameters": "shard the parameters: tp / pp, Gemini or FSDP",
    "gradients": "ZeRO stage 2, Gemini or FSDP to shard the gradients",
    "comm_buffers": "a smaller bucket, or fewer ranks gathering at once",
}


# what the sharding plugins already do, so the generic advice would send the user where they are
_SHARDED_SUGGESTIONS = {
    ("torch_fsdp", "gradients"): "one FSDP unit per decoder layer (fsdp_wrap='block') rather than one root unit, "
    "fewer accumulation micro-batches (no_sync keeps unsharded fp32 sums), or tp / pp (hybrid)",
    ("torch_fsdp", "parameters"): "one FSDP unit per decoder layer (fsdp_wrap='block'), more data-parallel ranks, "
    "or tp / pp (hybrid)",
    ("torch_fsdp", "optimizer_states"): "more data-parallel ranks to shard over, or tp / pp (hybrid)",
    ("torch_fsdp", "comm_buffers"): "one FSDP unit per decoder layer (fsdp_wrap='block'): fewer parameters gathered "
    "at once",
    ("gemini", "optimizer_states"): "Gemini's offload_optim_frac, or more data-parallel ranks",
    ("gemini", "parameters"): "Gemini's offload_param_frac, or more data-parallel ranks",
}


def _suggestion(plugin: str, name: str) -> str:
    return _SHARDED_SUGGESTIONS.get((plugin, name), _SUGGESTIONS[name])


def format_bytes(nbytes: int) -> str:
    """`91.3 GB` (10^9), `512 MB`, `3.1 KB`: the units the reason strings use."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True)
class Verdict:
    """The report's `MemoryVerdict`, with the prediction it judged."""

    fits: bool
    peak_bytes: int
    limit: int
    reason: str  # empty when it fits comfortably; for a tight fit, what it leaves of the reserve
    prediction: MemoryPrediction
    tight: bool = False  # fits only inside the reserve


def fits(prediction: MemoryPrediction, device_memory: int, usable_fraction: float = USABLE_FRACTION) -> Verdict:
    """Whether the prediction's peak fits `usable_fraction` of `device_memory` bytes; if not, which component
    (the largest) to cut and how."""
    if device_memory <= 0:
        raise ValueError(f"device memory must be positive, got {device_memory}")
    if not 0.0 < usable_fraction <= 1.0:
        raise ValueError(f"usable_fraction {usable_fraction} is not in (0, 1]")
    limit = int(device_memory * usable_fraction)
    peak = prediction.peak
    if peak <= limit:
        return Verdict(True, peak, limit, "", prediction)
    if peak <= device_memory:
        reason = (
            f"tight: peak {format_bytes(peak)} is inside the {1 - usable_fraction:.0%} reserve "
            f"(> {format_bytes(limit)} usable of {format_bytes(device_memory)}), leaving "
            f"{format_bytes(device_memory - peak)} for the CUDA context, NCCL and fragmentation"
        )
        return Verdict(True, peak, limit, reason, prediction, tight=True)
    name, nbytes = max(prediction.components().items(), key=lambda item: item[1])
    at = f" at micro-batch {prediction.candidate.micro_batch_size}" if name == "activations" else ""
    reason = (
        f"peak {format_bytes(peak)} > {format_bytes(device_memory)} of the device ({format_bytes(limit)} usable "
        f"beside the {1 - usable_fraction:.0%} reserve); largest: {name.replace('_', ' ')} {format_bytes(nbytes)}{at}; "
        f"try {_suggestion(prediction.candidate.plugin, name)}"
    )
    return Verdict(False, peak, limit, reason, prediction)
