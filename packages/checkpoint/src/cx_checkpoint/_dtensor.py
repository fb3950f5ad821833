"""Loading into DTensors (FSDP2, tensor parallelism): each rank reads only the region of every full tensor that its
local shard holds, straight from the shard files, and copies it into the local tensor in place.

The region follows `Shard(dim)` placements the way torch splits a tensor (`torch.chunk`: equal pieces of
ceil(n / parts), the last ones shorter or empty), applied mesh dimension by mesh dimension; `Replicate` keeps the
whole extent. Other placements (partial sums, strided shards) raise a clear error instead of loading wrongly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from cx_checkpoint._protocols import Region, TensorSpec

__all__ = ["DTensorModuleSink", "local_region"]


def local_region(tensor: DTensor) -> Region:
    """The part of the full tensor that this rank's local shard of `tensor` holds."""
    starts = [0] * tensor.dim()
    lengths = list(tensor.shape)
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not part of the DTensor's device mesh")
    for mesh_dim, placement in enumerate(tensor.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            raise NotImplementedError(
                f"loading into a DTensor placed as {placement} is not supported; redistribute it to Shard / Replicate "
                "placements first, or load through the plugin's checkpoint IO (Booster.load_model)"
            )
        dim = placement.dim
        parts = tensor.device_mesh.size(mesh_dim)
        piece = -(-lengths[dim] // parts)
        offset = min(coordinate[mesh_dim] * piece, lengths[dim])
        starts[dim] += offset
        lengths[dim] = max(0, min(piece, lengths[dim] - offset))
    local_shape = tuple(tensor.to_local().shape)
    if local_shape != tuple(lengths):
        raise NotImplementedError(
            f"a DTensor's local shard has shape {local_shape}, but its placements {tensor.placements} give "
            f"{tuple(lengths)}: this sharding layout is not supported for loading; redistribute to even Shard "
            "placements, or load the full tensor and distribute it"
        )
    return tuple(slice(start, start + length) for start, length in zip(starts, lengths, strict=True))


class DTensorModuleSink:
    """`TensorSink` over a module whose parameters and buffers may be DTensors (plain tensors are loaded whole)."""

    def __init__(self, module: nn.Module) -> None:
        self._targets = module.state_dict(keep_vars=True)

    def expected_tensors(self) -> Mapping[str, TensorSpec]:
        return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in self._targets.items()}

    def owned_region(self, name: str) -> Region | None:
        target = self._targets[name]
        return local_region(target) if isinstance(target, DTensor) else None

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        target = self._targets[name]
        local = target.to_local() if isinstance(target, DTensor) else target
        with torch.no_grad():
            local.copy_(tensor)
