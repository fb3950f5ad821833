"""`ZeroLayout`: the one object that owns a ZeRO plugin's mesh, its axes and its process groups.

Axes, in ColossalAI's order: `zero` (parameters/optimizer sharded), `extra_dp` (replicated data parallelism on top,
gradients reduced over it a second time) and `tp` (tensor parallelism). Data-parallel rank and size come from here
and nowhere else.

The two ZeRO plugins order the axes differently, as ColossalAI's do: Gemini's mesh is `(zero, extra_dp, tp)`
(its zero groups are strided across the world), LowLevelZero's is `(extra_dp, zero)`, so that its zero groups are
contiguous ranks (one node) and only the extra_dp reduction crosses nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from cx_mesh import ProcessGroup, ProcessGroupMesh

__all__ = ["ZeroLayout"]

ZERO_AXIS, EXTRA_DP_AXIS, TP_AXIS = "zero", "extra_dp", "tp"


@dataclass
class ZeroLayout:
    zero_size: int
    extra_dp_size: int
    tp_size: int
    mesh: ProcessGroupMesh
    zero_group: ProcessGroup
    extra_dp_group: ProcessGroup | None
    tp_group: ProcessGroup | None
    extra_dp_outer: bool = False

    @classmethod
    def build(cls, extra_dp_size: int = 1, tp_size: int = 1, extra_dp_outer: bool = False) -> ZeroLayout:
        """Split the world into (zero, extra_dp, tp), or (extra_dp, zero, tp) with `extra_dp_outer`; a clear error
        when the sizes do not divide it."""
        world = dist.get_world_size()
        for name, size in (("extra_dp_size", extra_dp_size), ("tp_size", tp_size)):
            if size < 1:
                raise ValueError(f"{name} must be a positive integer, got {size}")
        if world % (extra_dp_size * tp_size):
            raise ValueError(
                f"the world size {world} is not divisible by extra_dp_size * tp_size = {extra_dp_size} * {tp_size}"
            )
        zero_size = world // (extra_dp_size * tp_size)
        if extra_dp_outer:
            mesh = ProcessGroupMesh(extra_dp_size, zero_size, tp_size, axis_names=(EXTRA_DP_AXIS, ZERO_AXIS, TP_AXIS))
        else:
            mesh = ProcessGroupMesh(zero_size, extra_dp_size, tp_size, axis_names=(ZERO_AXIS, EXTRA_DP_AXIS, TP_AXIS))
        return cls(
            zero_size=zero_size,
            extra_dp_size=extra_dp_size,
            tp_size=tp_size,
            mesh=mesh,
            zero_group=mesh.get_group_along_axis(ZERO_AXIS),
            extra_dp_group=mesh.get_group_along_axis(EXTRA_DP_AXIS) if extra_dp_size > 1 else None,
            tp_group=mesh.get_group_along_axis(TP_AXIS) if tp_size > 1 else None,
            extra_dp_outer=extra_dp_outer,
        )

    @property
    def dp_size(self) -> int:
        return self.zero_size * self.extra_dp_size

    @property
    def dp_rank(self) -> int:
        """The rank among data-parallel replicas (ranks differing only in tp share it), in the mesh's own order."""
        zero, extra = self.mesh.coordinate(ZERO_AXIS), self.mesh.coordinate(EXTRA_DP_AXIS)
        return extra * self.zero_size + zero if self.extra_dp_outer else zero * self.extra_dp_size + extra
