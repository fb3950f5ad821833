"""Where each parameter's part lives for the optimizer, and optimizer state converted between full and sharded.

A `ShardEntry` ties a model parameter to the placeholder the wrapped optimizer steps and to this rank's flat range
of it inside its chunk. Saving gathers each elementwise state tensor chunk by chunk (a zero-padded own slice per
chunk, one all-gather), so the full state of one chunk exists at a time; scalar state (`step`) is taken as is.
Loading keeps the flat range this rank owns.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cx_chunk import Chunk
from cx_zero.gemini._gather import gather_shard

__all__ = ["ShardEntry", "full_states", "own_part"]


@dataclass
class ShardEntry:
    """One model parameter as the wrapped optimizer sees it: a placeholder and where this rank's part lives."""

    param: nn.Parameter  # the model parameter
    holder: nn.Parameter  # what the wrapped optimizer sees
    name: str
    chunk: Chunk
    begin: int  # this rank's part: elements [begin, end) of the flattened parameter ...
    end: int
    shard_begin: int  # ... are elements [shard_begin, shard_end) of the chunk's own slice
    shard_end: int


def full_states(
    entries: Sequence[ShardEntry], state: Mapping[Any, dict[str, Any]], chunks: Sequence[Chunk]
) -> Iterator[tuple[str, str, torch.Tensor | Any]]:
    """(param name, key, full value) for every state entry; elementwise tensors gathered chunk by chunk."""
    by_chunk: dict[int, list[ShardEntry]] = {}
    for entry in entries:
        by_chunk.setdefault(id(entry.chunk), []).append(entry)
    for chunk in chunks:
        members = by_chunk.get(id(chunk), [])
        keys: list[str] = []
        for entry in members:
            for key, value in state.get(entry.holder, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and str(key) not in keys:
                    keys.append(str(key))
        for key in keys:
            dtype = next(state[e.holder][key].dtype for e in members if key in state.get(e.holder, {}))
            shard = torch.zeros(chunk.shard_size, dtype=dtype)
            for entry in members:
                value = state.get(entry.holder, {}).get(key)
                if value is not None and entry.end > entry.begin:
                    shard[entry.shard_begin : entry.shard_end] = value.detach().cpu()
            full = gather_shard(shard, chunk)
            for entry in members:
                if key in state.get(entry.holder, {}):
                    slot = chunk.slot(entry.param)
                    yield entry.name, key, full[slot.begin : slot.end].view(slot.shape).clone()
        for entry in members:
            for key, value in state.get(entry.holder, {}).items():
                if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                    yield (
                        entry.name,
                        str(key),
                        value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value,
                    )


def own_part(entry: ShardEntry, value: Any, *, scalars_on_device: bool = False) -> Any:
    """This rank's part of a full state value: scalars as they are, elementwise tensors as the flat slice on the
    placeholder's device. 0-d tensors (Adam's `step`) go on the host, where torch optimizers keep them unless
    `capturable`/`fused` (`scalars_on_device`): a device scalar would cost a synchronisation on every step."""
    if not isinstance(value, torch.Tensor):
        return value
    device = entry.holder.device
    if value.dim() == 0:
        return value.detach().to(device if scalars_on_device else torch.device("cpu"), copy=True)
    slot = entry.chunk.slot(entry.param)
    if value.numel() != slot.numel:
        raise ValueError(
            f"GeminiOptimizer.load_state_dict: state of {entry.name!r} has shape {list(value.shape)}, the "
            f"parameter has {list(entry.chunk.slot(entry.param).shape)}"
        )
    flat = value.detach().reshape(-1)[entry.begin : entry.end]
    return flat.to(device, copy=True)
