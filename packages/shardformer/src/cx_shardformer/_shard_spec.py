"""How one parameter is split over a tensor-parallel group, and the two conversions full <-> local.

A `ShardSpec` says which dimension is split, the full sizes of the fused parts along it (q, k, v of a fused QKV
weight are split separately, so each rank holds its heads of every part) and, for vocabulary layers, the padded size
(the padding rows exist only in the local shards, never in a full tensor). The spec is attached to the `Parameter`
itself, so tied weights are sharded once and checkpoint code can ask any parameter how to gather it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import ProcessGroup, all_gather_flat

__all__ = ["ShardSpec", "get_shard_spec", "shard_parameter_", "shard_tensor", "unshard_tensor"]

_ATTRIBUTE = "cx_shard_spec"


@dataclass(frozen=True)
class ShardSpec:
    """`dim` is split over `world` ranks; `parts` are the full sizes of the fused parts along it (in order);
    `padded` is the size after vocabulary padding (the parts' sum when there is none)."""

    dim: int
    parts: tuple[int, ...]
    world: int
    padded: int

    @property
    def full(self) -> int:
        """The unpadded full size along `dim`."""
        return sum(self.parts)

    def local_parts(self) -> tuple[int, ...]:
        """This rank's size of each part (padding belongs to the last part)."""
        sizes = list(self.parts)
        sizes[-1] += self.padded - self.full
        return tuple(size // self.world for size in sizes)

    def full_shape(self, local_shape: torch.Size) -> torch.Size:
        shape = list(local_shape)
        shape[self.dim] = self.full
        return torch.Size(shape)


def get_shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The spec of a parameter sharded by cx-shardformer, or None for a replicated one."""
    spec = getattr(param, _ATTRIBUTE, None)
    return spec if isinstance(spec, ShardSpec) else None


def make_spec(dim: int, parts: tuple[int, ...], world: int, padded: int | None, what: str) -> ShardSpec:
    """Build a spec after checking every part (and the padded size) divides by the group size."""
    padded_size = sum(parts) if padded is None else padded
    last = parts[-1] + padded_size - sum(parts)
    for size in (*parts[:-1], last):
        if size % world != 0:
            raise ValueError(
                f"{what}: cannot split sizes {list(parts)} along dimension {dim} over {world} tensor-parallel ranks: "
                f"{size} is not divisible by {world}"
            )
    return ShardSpec(dim=dim, parts=parts, world=world, padded=padded_size)


def _local_slice(full: torch.Tensor, spec: ShardSpec, rank: int) -> torch.Tensor:
    if spec.padded > spec.full:
        pad_shape = list(full.shape)
        pad_shape[spec.dim] = spec.padded - spec.full
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=spec.dim)
    sizes = list(spec.parts)
    sizes[-1] += spec.padded - spec.full
    pieces = [part.chunk(spec.world, spec.dim)[rank] for part in full.split(sizes, spec.dim)]
    return torch.cat(pieces, dim=spec.dim).contiguous()


def shard_parameter_(param: torch.Tensor, spec: ShardSpec, group: ProcessGroup | None) -> nn.Parameter:
    """Replace `param`'s data by this rank's slice, keeping the same Parameter object (optimizers built before
    sharding keep pointing at it). A parameter already sharded with the same spec (a tied weight) is left alone."""
    if not isinstance(param, nn.Parameter):
        raise TypeError(f"only an nn.Parameter can be sharded in place, got {type(param).__name__}")
    existing = get_shard_spec(param)
    if existing is not None:
        if existing != spec:
            raise ValueError(f"parameter already sharded as {existing}, cannot re-shard it as {spec}")
        return param
    if param.shape[spec.dim] != spec.full:
        raise ValueError(
            f"parameter of shape {tuple(param.shape)} has size {param.shape[spec.dim]} along "
            f"dimension {spec.dim}, the layer expects {spec.full}"
        )
    with torch.no_grad():
        param.data = _local_slice(param.data, spec, int(dist.get_rank(group)))
    setattr(param, _ATTRIBUTE, spec)
    return param


def shard_tensor(full: torch.Tensor, spec: ShardSpec, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's slice of a full-size tensor (loading a checkpoint; optimizer state of a sharded parameter has the
    parameter's local shape and splits and gathers with the same spec)."""
    return _local_slice(full, spec, int(dist.get_rank(group)))


def unshard_tensor(local: torch.Tensor, spec: ShardSpec, group: ProcessGroup | None) -> torch.Tensor:
    """The full-size tensor (padding stripped) from every rank's slice; a collective over `group`."""
    local = local.detach().movedim(spec.dim, 0).contiguous()
    gathered = torch.empty((spec.world * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    all_gather_flat(gathered.view(-1), local.view(-1), group)
    per_rank = [piece.split(list(spec.local_parts()), 0) for piece in gathered.chunk(spec.world, 0)]
    parts = [torch.cat([pieces[i] for pieces in per_rank], 0) for i in range(len(spec.parts))]
    full = torch.cat(parts, 0)[: spec.full]
    return full.movedim(0, spec.dim).contiguous()
