"""Adapter "this tensor is a TP shard": between a rank's local tensor-parallel slices and the full tensors the
canonical checkpoint holds.

A `TensorParallelShards` knows, by parameter name, the cx-shardformer `ShardSpec` and the local shape of every
parameter split over the TP group. Saving gathers a local tensor into the full one (`unshard_tensor`, a collective
over the TP group; vocabulary padding stripped); loading cuts this rank's slice from a full tensor (`shard_tensor`,
local). Optimizer state entries shaped like their parameter's local slice use the parameter's spec; scalars
(`step`) and replicated parameters pass through unchanged. It wraps any cx-checkpoint `TensorSource` /
`TensorSink` speaking local shapes, so a ZeRO or Gemini owner gains TP by composition.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cx_checkpoint import Region, TensorSink, TensorSource, TensorSpec
from cx_mesh import ProcessGroup
from cx_shardformer import ShardSpec, get_shard_spec, shard_tensor, unshard_tensor

__all__ = ["SplitParam", "TensorParallelShards", "parameter_of_state"]

_STATE_PREFIX = "state."


@dataclass(frozen=True)
class SplitParam:
    """How one parameter is split: its spec and this rank's local shape."""

    spec: ShardSpec
    local_shape: tuple[int, ...]

    @property
    def full_shape(self) -> tuple[int, ...]:
        return tuple(self.spec.full_shape(torch.Size(self.local_shape)))


def parameter_of_state(tensor_name: str) -> tuple[str, str] | None:
    """`state.<param>.<key>` -> (param, key); None for other names (keys never contain a dot)."""
    if not tensor_name.startswith(_STATE_PREFIX):
        return None
    param, _, key = tensor_name[len(_STATE_PREFIX) :].rpartition(".")
    return (param, key) if param and key else None


class TensorParallelShards:
    """The TP-split parameters of a model by name, and the gather / scatter of tensors shaped like them."""

    def __init__(self, split: Mapping[str, SplitParam], group: ProcessGroup | None) -> None:
        self.split = dict(split)
        self.group = group

    @classmethod
    def of_module(
        cls, module: nn.Module, group: ProcessGroup | None, local_shapes: Mapping[str, tuple[int, ...]] | None = None
    ) -> TensorParallelShards:
        """Every parameter of `module` carrying a `ShardSpec`, under all its names (tied ones included). Local
        shapes come from `local_shapes` when given (owners that release parameter storage, as Gemini does)."""
        split: dict[str, SplitParam] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            spec = get_shard_spec(param)
            if spec is not None:
                known = local_shapes.get(name) if local_shapes is not None else None
                shape = tuple(known) if known is not None else tuple(param.shape)
                split[name] = SplitParam(spec, shape)
        return cls(split, group)

    def _split_of(self, name: str, shape: tuple[int, ...], full: bool) -> SplitParam | None:
        """The split of the parameter a tensor named `name` belongs to, when the tensor is shaped like that
        parameter's local (or, with `full`, full) tensor; None when it passes through unchanged."""
        owner = parameter_of_state(name)
        split = self.split.get(owner[0] if owner is not None else name)
        if split is None:
            return None
        expected = split.full_shape if full else split.local_shape
        return split if shape == expected else None

    # ---- saving ---------------------------------------------------------------------------------------------
    def gather(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The full tensor of a local one (collective over the TP group when it is a TP shard)."""
        split = self._split_of(name, tuple(tensor.shape), full=False)
        if split is None:
            return tensor
        return unshard_tensor(tensor, split.spec, self.group)

    def source(self, inner: TensorSource) -> TensorSource:
        """`inner`'s stream with every TP shard gathered. Every rank of the TP group must iterate it, in step,
        with the same names (owners that yield on their saving ranks only need those ranks to form the group)."""
        return _GatheringSource(self, inner)

    # ---- loading --------------------------------------------------------------------------------------------
    def scatter(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full tensor (local: no communication)."""
        split = self._split_of(name, tuple(full.shape), full=True)
        if split is None:
            return full
        return shard_tensor(full, split.spec, self.group)

    def full_spec(self, name: str, local: TensorSpec) -> TensorSpec:
        split = self._split_of(name, local.shape, full=False)
        return local if split is None else TensorSpec(split.full_shape, local.dtype)

    def scatter_state(self, state: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        return {
            name: {
                key: self.scatter(f"{_STATE_PREFIX}{name}.{key}", value) if isinstance(value, torch.Tensor) else value
                for key, value in entries.items()
            }
            for name, entries in state.items()
        }

    def sink(self, inner: TensorSink) -> TensorSink:
        """`inner` (which expects local shapes) fed from full tensors: each rank keeps its TP slice."""
        return _ScatteringSink(self, inner)


class _GatheringSource:
    def __init__(self, shards: TensorParallelShards, inner: TensorSource) -> None:
        self._shards = shards
        self._inner = inner

    def tensor_chunks(self, max_bytes: int) -> Iterator[Mapping[str, torch.Tensor]]:
        for chunk in self._inner.tensor_chunks(max_bytes):
            yield {name: self._shards.gather(name, tensor) for name, tensor in chunk.items()}


class _ScatteringSink:
    def __init__(self, shards: TensorParallelShards, inner: TensorSink) -> None:
        self._shards = shards
        self._inner = inner
        self._local = dict(inner.expected_tensors())

    def expected_tensors(self) -> Mapping[str, TensorSpec]:
        return {name: self._shards.full_spec(name, spec) for name, spec in self._local.items()}

    def owned_region(self, name: str) -> Region | None:
        return None  # fused q/k/v parts and padding make a slice non-rectangular: read whole, cut locally

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        self._inner.receive(name, self._shards.scatter(name, tensor))
