"""Optimizer data moved into spare device memory after warm-up: ColossalAI's `gpu_margin_mem_ratio`.

With `placement_policy="auto"` every chunk's master, gradient and optimizer state starts on the host. After the
first step (the warm-up trace is recorded by then) the spare device memory in steady state is measured
(`AutoPlacementPolicy.optimizer_margin`: hard limit less the largest non-model figure and the chunk payload peak),
agreed across the zero group (the smallest figure wins), and `ratio` of it is filled, chunk by chunk in layout order,
with the optimizer data of whole chunks: their companion chunks move to the device and so do the optimizer's state
tensors of their parameters, so those chunks step on the device while the rest step on the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cx_chunk import AutoPlacementPolicy, Chunk, ChunkManager, Residence, StepTrace
from cx_mesh import ProcessGroup, all_reduce, communication_device
from cx_zero.gemini._shards import ShardEntry

__all__ = ["use_device_margin"]


def _agreed_min(value: int, group: ProcessGroup | None) -> int:
    figure = torch.tensor([value], dtype=torch.int64, device=communication_device(group))
    all_reduce(figure, op=dist.ReduceOp.MIN, group=group)
    return int(figure.item())


def _elementwise(state: Mapping[str, Any]) -> list[str]:
    return [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]


def use_device_margin(
    policy: AutoPlacementPolicy,
    manager: ChunkManager,
    trace: StepTrace,
    ratio: float,
    entries: Sequence[ShardEntry],
    state: dict[Any, dict[str, Any]],
    device: torch.device,
) -> list[Chunk]:
    """Move the optimizer data of as many chunks as fit in `ratio` of the spare device memory; returns them."""
    budget = int(_agreed_min(policy.optimizer_margin(manager, trace), manager.group) * ratio)
    by_chunk: dict[int, list[ShardEntry]] = {}
    for entry in entries:
        by_chunk.setdefault(id(entry.chunk), []).append(entry)
    moved: list[Chunk] = []
    used = 0
    for chunk in manager.chunks("param"):
        members = by_chunk.get(id(chunk), [])
        if not members or policy.optimizer_residence(chunk) is Residence.DEVICE:
            continue
        companions = sum(c.memory_usage().host for c in manager.companions(chunk))
        outside = sum(
            state[e.holder][k].numel() * state[e.holder][k].element_size()
            for e in members
            if e.holder in state
            for k in _elementwise(state[e.holder])
        )
        if used + companions + outside > budget:
            break  # layout order: the chunks that fit are a prefix, the same on every rank
        policy.keep_optimizer_on_device(manager, chunk, reserved_bytes=outside)
        for e in members:
            for key in _elementwise(state.get(e.holder, {})):
                state[e.holder][key] = state[e.holder][key].to(device)
        used += companions + outside
        moved.append(chunk)
    return moved
