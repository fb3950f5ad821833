"""`PerTestCache`: a dict that lives for one distributed test.

Pooled ranks outlive a test, and at its end they destroy the process groups it created (an idle gloo group keeps
native threads polling). A helper that shares groups or meshes between the calls of one test keeps them here: the
worker empties every such cache before destroying the groups, so no later test is handed a destroyed group.
"""

from __future__ import annotations

import weakref
from typing import TypeVar

__all__ = ["PerTestCache", "clear_per_test_caches"]

K = TypeVar("K")
V = TypeVar("V")

_CACHES: weakref.WeakSet[PerTestCache[object, object]] = weakref.WeakSet()


class PerTestCache(dict[K, V]):
    """A dict emptied when each distributed test ends, e.g. `_MESHES: PerTestCache[int, ProcessGroupMesh]`."""

    def __init__(self) -> None:
        super().__init__()
        _CACHES.add(self)  # type: ignore[arg-type]

    __hash__ = object.__hash__  # type: ignore[assignment]  # a WeakSet member: hashed by identity, not contents


def clear_per_test_caches() -> None:
    """Empty every PerTestCache of this process (the pooled worker calls it when a test ends)."""
    for cache in list(_CACHES):
        cache.clear()
