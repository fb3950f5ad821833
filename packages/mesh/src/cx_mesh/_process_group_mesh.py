"""`ProcessGroupMesh`: the job's ranks arranged as an N-d grid, and the process groups along its axes.

Ranks are laid out in C order (the last axis varies fastest). A group "along axis a" holds the ranks that share this
rank's coordinates on every other axis. Creating a group is collective over the whole world, so when any rank asks
for groups along an axis, the mesh creates every group of that axis in the same order on every rank; groups are
cached, so later calls are free and never deadlock. Every group uses the job's collective timeout (the one given to
`launch`) and carries a description naming its mesh axes, so a timed-out collective can say which group it was.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from datetime import timedelta
from typing import Literal, cast, overload

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cx_mesh._accelerator import get_accelerator
from cx_mesh._collectives import ProcessGroup, require_initialized
from cx_mesh._timeouts import collective_timeout, remember_group_timeout

__all__ = ["Axis", "ProcessGroupMesh"]

Axis = int | str
_GroupKey = tuple[tuple[int, ...], tuple[tuple[int, ...], ...], str | None]


class ProcessGroupMesh:
    """An N-d grid of the world's ranks with cached process groups along any axis or set of axes.

    `ProcessGroupMesh(2, 2, axis_names=("dp", "tp"))` on 4 ranks puts ranks 0,1 in one tp group and 0,2 in one dp
    group. Axes can be addressed by index or by name.
    """

    def __init__(self, *sizes: int, axis_names: Sequence[str] | None = None, timeout: timedelta | None = None) -> None:
        require_initialized("ProcessGroupMesh")
        if timeout is not None and timeout <= timedelta(0):
            raise ValueError(f"ProcessGroupMesh timeout must be positive, got {timeout}")
        if not sizes:
            raise ValueError("ProcessGroupMesh needs at least one axis size, e.g. ProcessGroupMesh(world_size)")
        if any(not isinstance(size, int) or size < 1 for size in sizes):
            raise ValueError(f"ProcessGroupMesh sizes must be positive integers, got {sizes}")
        world_size = dist.get_world_size()
        if math.prod(sizes) != world_size:
            raise ValueError(
                f"ProcessGroupMesh sizes {sizes} multiply to {math.prod(sizes)}, but the world has {world_size} ranks"
            )
        names = tuple(axis_names) if axis_names is not None else None
        if names is not None:
            if len(names) != len(sizes):
                raise ValueError(f"axis_names {names} has {len(names)} names for {len(sizes)} axes")
            if len(set(names)) != len(names):
                raise ValueError(f"axis_names must be distinct, got {names}")
        self._shape: tuple[int, ...] = tuple(sizes)
        self._axis_names = names
        self._rank = dist.get_rank()
        self._coordinate = self.unravel(self._rank, self._shape)
        self._timeout = timeout if timeout is not None else collective_timeout()
        self._groups: dict[_GroupKey, ProcessGroup | None] = {}
        self._ranks_of_group: dict[ProcessGroup, tuple[int, ...]] = {}

    # ---- geometry -----------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def axis_names(self) -> tuple[str, ...] | None:
        return self._axis_names

    @property
    def timeout(self) -> timedelta:
        """How long a collective on this mesh's groups may wait before it raises (the job's, unless given)."""
        return self._timeout

    def axis_index(self, axis: Axis) -> int:
        """Resolve an axis given by index or name; a clear error for anything out of range."""
        ndim = len(self._shape)
        if isinstance(axis, str):
            if self._axis_names is None or axis not in self._axis_names:
                raise ValueError(f"unknown axis name {axis!r}; this mesh's axes are {self._axis_names}")
            return self._axis_names.index(axis)
        if not -ndim <= axis < ndim:
            raise IndexError(f"axis {axis} is out of range for a mesh of {ndim} axes (shape {self._shape})")
        return axis % ndim

    def size(self, axis: Axis | None = None) -> int:
        """Ranks along `axis`, or the whole mesh's rank count when `axis` is None."""
        if axis is None:
            return math.prod(self._shape)
        return self._shape[self.axis_index(axis)]

    @overload
    def coordinate(self, axis: None = None) -> tuple[int, ...]: ...

    @overload
    def coordinate(self, axis: Axis) -> int: ...

    def coordinate(self, axis: Axis | None = None) -> int | tuple[int, ...]:
        """This rank's index along `axis`, or its full coordinate when `axis` is None."""
        if axis is None:
            return self._coordinate
        return self._coordinate[self.axis_index(axis)]

    @staticmethod
    def unravel(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
        """The coordinate of `rank` in a C-order grid of `shape`."""
        total = math.prod(shape)
        if not 0 <= rank < total:
            raise ValueError(f"rank {rank} is outside a mesh of shape {tuple(shape)} ({total} ranks)")
        coordinate = []
        for size in reversed(shape):
            rank, index = divmod(rank, size)
            coordinate.append(index)
        return tuple(reversed(coordinate))

    @staticmethod
    def ravel(coordinate: Sequence[int], shape: Sequence[int], mode: Literal["raise", "wrap"] = "raise") -> int:
        """The rank at `coordinate` in a C-order grid; `mode="wrap"` takes each index modulo its axis size."""
        if len(coordinate) != len(shape):
            raise ValueError(f"coordinate {tuple(coordinate)} has {len(coordinate)} axes, shape {tuple(shape)}")
        rank = 0
        for index, size in zip(coordinate, shape, strict=True):
            if mode == "wrap":
                index %= size
            elif mode != "raise":
                raise ValueError(f"ravel mode must be 'raise' or 'wrap', got {mode!r}")
            elif not 0 <= index < size:
                raise ValueError(f"coordinate {tuple(coordinate)} is outside shape {tuple(shape)}")
            rank = rank * size + index
        return rank

    # ---- groups -------------------------------------------------------------------------------------------
    def _normalise(
        self, axis: Axis | Sequence[Axis], indices_at_axis: Sequence[int] | Sequence[Sequence[int]] | None
    ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        if isinstance(axis, int | str):
            axes: tuple[int, ...] = (self.axis_index(axis),)
            per_axis: Sequence[Sequence[int]] | None = (
                None if indices_at_axis is None else (cast(Sequence[int], indices_at_axis),)
            )
        else:
            axes = tuple(self.axis_index(a) for a in axis)
            if not axes:
                raise ValueError("get_group_along_axis needs at least one axis")
            per_axis = None if indices_at_axis is None else cast(Sequence[Sequence[int]], indices_at_axis)
        if len(set(axes)) != len(axes):
            raise ValueError(f"axes {axes} repeat an axis")
        if per_axis is None:
            indices = tuple(tuple(range(self._shape[a])) for a in axes)
        else:
            if len(per_axis) != len(axes):
                raise ValueError(f"indices_at_axis gives {len(per_axis)} index lists for {len(axes)} axes")
            indices = tuple(tuple(int(i) for i in idx) for idx in per_axis)
            for a, idx in zip(axes, indices, strict=True):
                if not idx or any(not 0 <= i < self._shape[a] for i in idx):
                    raise ValueError(f"indices {idx} along axis {a} must be non-empty and in [0, {self._shape[a]})")
        return axes, indices

    def _ranks_along(
        self, base: Sequence[int], axes: tuple[int, ...], indices: tuple[tuple[int, ...], ...]
    ) -> tuple[int, ...]:
        ranks = []
        for combo in itertools.product(*indices):
            coordinate = list(base)
            for a, i in zip(axes, combo, strict=True):
                coordinate[a] = i
            ranks.append(self.ravel(coordinate, self._shape))
        return tuple(sorted(ranks))

    def _all_rank_sets(self, axes: tuple[int, ...], indices: tuple[tuple[int, ...], ...]) -> list[tuple[int, ...]]:
        other_axes = [a for a in range(len(self._shape)) if a not in axes]
        rank_sets = []
        for other in itertools.product(*(range(self._shape[a]) for a in other_axes)):
            base = [0] * len(self._shape)
            for a, i in zip(other_axes, other, strict=True):
                base[a] = i
            rank_sets.append(self._ranks_along(base, axes, indices))
        return rank_sets

    def create_group_along_axis(
        self,
        axis: Axis | Sequence[Axis],
        indices_at_axis: Sequence[int] | Sequence[Sequence[int]] | None = None,
        backend: str | None = None,
    ) -> ProcessGroup | None:
        """Create (collectively: every rank must call it) all groups along `axis`; return this rank's, or None.

        None is returned on ranks outside every created group, which is possible with a partial `indices_at_axis`.
        The result is cached; later calls with the same arguments return it without communicating.
        """
        axes, indices = self._normalise(axis, indices_at_axis)
        key: _GroupKey = (axes, indices, backend)
        if key in self._groups:
            return self._groups[key]
        mine: ProcessGroup | None = None
        description = self._describe(axes)
        for ranks in self._all_rank_sets(axes, indices):
            group = dist.new_group(list(ranks), backend=backend, timeout=self._timeout, group_desc=description)
            if self._rank in ranks:
                remember_group_timeout(group, self._timeout)
                mine = group
                self._ranks_of_group[group] = ranks
        if mine is not None and dist.get_backend(mine) == dist.Backend.GLOO:
            # gloo connects each pair at creation, and one rank can return while its peer is still reading the
            # handshake: a group destroyed (or a process ended) at once then failed the peer's `new_group` with
            # "connectFullMesh failed ... Connection closed by peer" (1 run in 8 on a loaded 2-core machine)
            dist.barrier(group=mine)
        self._groups[key] = mine
        return mine

    def _describe(self, axes: tuple[int, ...]) -> str:
        names = [self._axis_names[a] if self._axis_names else f"axis {a}" for a in axes]
        return f"cx mesh {self._shape} along {' x '.join(names)}"

    def get_group_along_axis(
        self,
        axis: Axis | Sequence[Axis],
        indices_at_axis: Sequence[int] | Sequence[Sequence[int]] | None = None,
        backend: str | None = None,
    ) -> ProcessGroup:
        """This rank's group along `axis` (one axis or a list of axes), created on first use and cached.

        Collective on first use, like `create_group_along_axis`. Raises `ValueError` on a rank that the requested
        `indices_at_axis` leave out (after taking part in the creation, so no rank is left waiting); such ranks
        should call `create_group_along_axis`, which returns None for them.
        """
        group = self.create_group_along_axis(axis, indices_at_axis, backend)
        if group is None:
            raise ValueError(
                f"rank {self._rank} (coordinate {self._coordinate}) is not in any group along axis {axis!r} "
                f"with indices_at_axis={indices_at_axis!r}; use create_group_along_axis, which returns None here"
            )
        return group

    def get_ranks_in_group(self, group: ProcessGroup) -> list[int]:
        """Global ranks of a group this mesh created (or any group, through torch)."""
        known = self._ranks_of_group.get(group)
        if known is not None:
            return list(known)
        return list(dist.get_process_group_ranks(group))

    def destroy_mesh_process_groups(self) -> None:
        """Destroy every group this mesh created (this rank's handles); the mesh can create them again."""
        for group in set(self._ranks_of_group):
            dist.destroy_process_group(group)
        self._groups.clear()
        self._ranks_of_group.clear()

    # ---- interop ------------------------------------------------------------------------------------------
    def to_device_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """The matching torch `DeviceMesh` (for DTensor), built from this mesh's own groups via the public API."""
        groups = [self.get_group_along_axis(axis) for axis in range(len(self._shape))]
        grid = torch.arange(self.size()).reshape(self._shape)
        return DeviceMesh.from_group(
            groups if len(groups) > 1 else groups[0],
            device_type or get_accelerator().name,
            mesh=grid,
            mesh_dim_names=self._axis_names,
        )

    def __repr__(self) -> str:
        names = f", axis_names={self._axis_names}" if self._axis_names else ""
        return f"ProcessGroupMesh(shape={self._shape}{names}, rank={self._rank}, coordinate={self._coordinate})"
