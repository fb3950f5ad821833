"""Full values of a chunk without changing its state: for state dicts and checkpoints.

A parameter chunk that is gathered already exposes its buffer; otherwise (and for master or optimizer-state chunks,
which only ever hold their own slice) the own slices are all-gathered into a temporary buffer on the group's
communication device. Every rank of the chunk's group must call this for the same chunks in the same order.
"""

from __future__ import annotations

import torch

from cx_chunk import Chunk
from cx_zero._comm import gather_to_cpu

__all__ = ["full_chunk", "gather_shard"]


def gather_shard(shard: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """All-gather one own slice laid out like `chunk` (keep_gathered or group of one: already full); CPU result."""
    return gather_to_cpu(shard, chunk.group, 1 if chunk.keep_gathered else chunk.group_size)


def full_chunk(chunk: Chunk) -> torch.Tensor:
    """The whole chunk (1-D, CPU copy) whether or not it is gathered right now."""
    if chunk.is_gathered:
        return _buffer(chunk)
    return gather_shard(chunk.own_values(), chunk)


def _buffer(chunk: Chunk) -> torch.Tensor:
    """The gathered buffer's copy on CPU, rebuilt from the tensor views (the buffer itself is private)."""
    out = torch.zeros(chunk.chunk_size, dtype=chunk.dtype)
    for tensor, slot in zip(chunk.tensors, chunk.slots, strict=True):
        out[slot.begin : slot.end] = chunk.tensor_view(tensor).reshape(-1).cpu()
    return out
