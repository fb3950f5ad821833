"""The typed protocols through which distributed owners of state take part in saving and loading.

Saving: a `TensorSource` yields full tensors by global name, a bounded number of bytes at a time, so a ZeRO chunk,
a tensor-parallel shard or an expert on one rank can gather and stream without holding the whole model.
Loading: a `TensorSink` says which tensors it expects (full shapes and dtypes, for verification), which region of
each full tensor it owns, and receives exactly that region, read lazily from the shard files.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["Region", "TensorSink", "TensorSource", "TensorSpec", "iter_source"]

Region = tuple[slice, ...]
"""A rectangular part of a full tensor: one `slice(start, stop)` per leading dimension (step 1)."""


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of a full (unsharded) tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


@runtime_checkable
class TensorSource(Protocol):
    """Something that can hand over its state as full tensors keyed by global name, in bounded pieces."""

    def tensor_chunks(self, max_bytes: int) -> Iterator[Mapping[str, torch.Tensor]]:
        """Yield dicts of full tensors by global name, each at most `max_bytes` (one larger tensor goes alone).

        A rank that owns nothing yields nothing. Names must be unique across all ranks taking part in one save.
        """
        ...


@runtime_checkable
class TensorSink(Protocol):
    """Something that takes its state from full tensors by global name, keeping only the part it owns."""

    def expected_tensors(self) -> Mapping[str, TensorSpec]:
        """Every global name this rank needs, with the FULL tensor's shape and dtype (checked against the file)."""
        ...

    def owned_region(self, name: str) -> Region | None:
        """The part of full tensor `name` this rank keeps (None: all of it). Only that part is read from disk."""
        ...

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        """Take `tensor`: the region of `name` given by `owned_region` (a CPU tensor the sink may keep or copy)."""
        ...


def iter_source(source: TensorSource, max_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Flatten a `TensorSource` into the (name, tensor) stream the shard writer consumes."""
    for chunk in source.tensor_chunks(max_bytes):
        yield from chunk.items()
