"""ravel/unravel: C-order round trips (property-based) and wrap mode; no processes needed."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cx_mesh import ProcessGroupMesh

shapes = st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=4).map(tuple)


@given(shapes, st.data())
def test_mesh_ravel_unravel_round_trip(shape: tuple[int, ...], data: st.DataObject) -> None:
    rank = data.draw(st.integers(min_value=0, max_value=math.prod(shape) - 1))
    coordinate = ProcessGroupMesh.unravel(rank, shape)
    assert all(0 <= c < s for c, s in zip(coordinate, shape, strict=True))
    assert ProcessGroupMesh.ravel(coordinate, shape) == rank


@pytest.mark.parametrize("shape", [(4,), (2, 2), (2, 1, 2), (2, 2, 2), (3, 1, 4)])
def test_mesh_ravel_is_c_order(shape: tuple[int, ...]) -> None:
    for rank, coordinate in enumerate(itertools.product(*(range(s) for s in shape))):
        assert ProcessGroupMesh.ravel(coordinate, shape) == rank
        assert ProcessGroupMesh.unravel(rank, shape) == coordinate


@given(shapes, st.data())
def test_mesh_ravel_wrap_takes_modulo(shape: tuple[int, ...], data: st.DataObject) -> None:
    coordinate = data.draw(st.tuples(*(st.integers(min_value=-10, max_value=10) for _ in shape)))
    wrapped = tuple(c % s for c, s in zip(coordinate, shape, strict=True))
    assert ProcessGroupMesh.ravel(coordinate, shape, mode="wrap") == ProcessGroupMesh.ravel(wrapped, shape)


def test_mesh_ravel_rejects_out_of_range() -> None:
    with pytest.raises(ValueError, match="outside shape"):
        ProcessGroupMesh.ravel((2, 0), (2, 2))
    with pytest.raises(ValueError, match="outside a mesh"):
        ProcessGroupMesh.unravel(4, (2, 2))
    with pytest.raises(ValueError, match="2 axes"):
        ProcessGroupMesh.ravel((0, 0), (2, 2, 2))
