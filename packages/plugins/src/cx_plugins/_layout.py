"""`ParallelLayout`: the one object that owns a plugin's mesh, its named axes and its process groups.

Every plugin describes its parallelism as an ordered list of axes with sizes, in ColossalAI's order for that plugin:

| plugin | axes (outermost first) |
|---|---|
| GeminiPlugin | (zero, extra_dp, tp) |
| LowLevelZeroPlugin | (extra_dp, zero): each zero group is a block of contiguous ranks |
| HybridParallelPlugin | (dp, pp, tp, sp), or (pp, dp, tp, sp) with `dp_outside=False` |
| MoeHybridParallelPlugin | (moe_dp, pp, ep, tp, sp), or (pp, moe_dp, ep, tp, sp) with `moe_dp_outside=False` |

Sizes are checked before any collective, with an error that names the sizes that would work. Ranks, sizes and groups
come from here and nowhere else: a plugin asks `layout.size(Axis.TP)`, `layout.group(Axis.DP, Axis.SP)`, and
`layout.data_rank_and_size()` for the data sharding, never computing a rank by hand.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from cx_mesh import ProcessGroup, ProcessGroupMesh

__all__ = ["FILL", "Axis", "LayoutError", "ParallelLayout", "resolve_sizes"]


class Axis(enum.Enum):
    """The named axes a cx plugin may split the world along."""

    DP = "dp"
    PP = "pp"
    TP = "tp"
    SP = "sp"
    EP = "ep"
    MOE_DP = "moe_dp"
    ZERO = "zero"
    EXTRA_DP = "extra_dp"


class LayoutError(ValueError):
    """The requested sizes cannot split the world (raised on every rank, before any collective)."""


FILL = -1
"""A size to be inferred: the world divided by the product of the other sizes (at most one axis)."""


@dataclass
class ParallelLayout:
    """The mesh of one plugin: `axes` in mesh order with their `sizes`; `data_axes` are the axes whose ranks see
    different data (the data-parallel dimension a dataloader shards over)."""

    axes: tuple[Axis, ...]
    sizes: tuple[int, ...]
    data_axes: tuple[Axis, ...]
    mesh: ProcessGroupMesh
    _groups: dict[tuple[Axis, ...], ProcessGroup] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls, axes: Sequence[tuple[Axis, int]], data_axes: Sequence[Axis], world_size: int | None = None
    ) -> ParallelLayout:
        """Split the world along `axes` (outermost first); one size may be `FILL` (-1) to take what is left.

        Collective only in the process groups it later creates; the size check itself is local, so a bad size
        raises the same `LayoutError` on every rank without any communication.
        """
        names = [axis for axis, _ in axes]
        if len(set(names)) != len(names):
            raise LayoutError(f"an axis appears twice in {[a.value for a in names]}")
        unknown = [a.value for a in data_axes if a not in names]
        if unknown:
            raise LayoutError(f"data axes {unknown} are not axes of the layout {[a.value for a in names]}")
        world = dist.get_world_size() if world_size is None else world_size
        sizes = resolve_sizes(axes, world)
        mesh = ProcessGroupMesh(*sizes, axis_names=tuple(a.value for a in names))
        return cls(axes=tuple(names), sizes=sizes, data_axes=tuple(data_axes), mesh=mesh)

    # ---- sizes and coordinates ----------------------------------------------------------------------------
    def size(self, *axes: Axis) -> int:
        """The product of the sizes of `axes` (1 for an axis the layout does not have)."""
        return math.prod(self.sizes[self.axes.index(a)] if a in self.axes else 1 for a in axes)

    def rank(self, *axes: Axis) -> int:
        """This rank's coordinate along `axes` taken together (row-major in the given order; 0 for absent axes)."""
        index = 0
        for axis in axes:
            index = index * self.size(axis) + (self.mesh.coordinate(axis.value) if axis in self.axes else 0)
        return index

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    # ---- groups ---------------------------------------------------------------------------------------------
    def group(self, *axes: Axis) -> ProcessGroup:
        """This rank's group spanning `axes` (collective on first use, then cached); axes the layout does not have
        are ignored, and at least one must be present."""
        present = tuple(a for a in axes if a in self.axes)
        if not present:
            raise LayoutError(f"none of {[a.value for a in axes]} is an axis of {[a.value for a in self.axes]}")
        cached = self._groups.get(present)
        if cached is None:
            cached = self.mesh.get_group_along_axis([self.axes.index(a) for a in present])
            self._groups[present] = cached
        return cached

    def group_or_none(self, *axes: Axis) -> ProcessGroup | None:
        """The group along `axes`, or None when they span one rank (no communication needed)."""
        return self.group(*axes) if self.size(*axes) > 1 else None

    def ranks(self, *axes: Axis) -> list[int]:
        """The global ranks of this rank's group along `axes`."""
        return self.mesh.get_ranks_in_group(self.group(*axes))

    # ---- data ---------------------------------------------------------------------------------------------
    def data_rank_and_size(self) -> tuple[int, int]:
        """(rank, size) along the data axes, in mesh order: ranks differing only in other axes share data."""
        ordered = tuple(a for a in self.axes if a in self.data_axes)
        return self.rank(*ordered), self.size(*ordered)

    def describe(self) -> str:
        return " x ".join(f"{a.value}={s}" for a, s in zip(self.axes, self.sizes, strict=True))


def resolve_sizes(axes: Sequence[tuple[Axis, int]], world: int) -> tuple[int, ...]:
    """The sizes with `FILL` resolved; a `LayoutError` naming the sizes that would work when they do not fit."""
    fill = [axis for axis, size in axes if size == FILL]
    if len(fill) > 1:
        raise LayoutError(f"at most one axis size can be inferred, got {[a.value for a in fill]}")
    for axis, size in axes:
        if size != FILL and (not isinstance(size, int) or size < 1):
            raise LayoutError(f"{axis.value}_size must be a positive integer, got {size!r}")
    fixed = [(axis, size) for axis, size in axes if size != FILL]
    product = math.prod(size for _, size in fixed)
    if world % product or (not fill and world != product):
        raise LayoutError(_explain(fixed, world, exact=not fill))
    return tuple(world // product if size == FILL else size for _, size in axes)


def _explain(fixed: Sequence[tuple[Axis, int]], world: int, exact: bool) -> str:
    """E.g. "the world size 8 is not divisible by tp*pp = 2*3 = 6; pp can be 1, 2 or 4 (with tp=2)"."""
    shown = [(a, s) for a, s in fixed if s > 1] or list(fixed[:1])
    product = math.prod(s for _, s in shown)
    relation = "equal to" if exact else "divisible by"
    if len(shown) == 1:
        message = f"the world size {world} is not {relation} {shown[0][0].value}_size = {product}"
    else:
        names, values = "*".join(a.value for a, _ in shown), "*".join(str(s) for _, s in shown)
        message = f"the world size {world} is not {relation} {names} = {values} = {product}"
    # suggest sizes for the largest axis whose partners divide the world; failing that, the world sizes that fit
    for axis, _ in sorted(shown, key=lambda item: -item[1]):
        others = [(a, s) for a, s in shown if a is not axis]
        rest = math.prod(s for _, s in others)
        if world % rest == 0:
            left = world // rest
            options = [d for d in range(1, left + 1) if left % d == 0 and (not exact or d == left)]
            listed = ", ".join(str(d) for d in options[:-1]) + (" or " if len(options) > 1 else "") + str(options[-1])
            context = f" (with {', '.join(f'{a.value}_size={s}' for a, s in others)})" if others else ""
            return message + f"; {axis.value}_size can be {listed}{context}"
    return message + (f"; launch {product} processes" if exact else f"; launch a multiple of {product} processes")
