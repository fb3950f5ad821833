"""`WeakLookup`: key -> value with both sides held weakly, for what a plugin remembers about each boosted optimizer.

A plugin's checkpoint IO looks up, per optimizer the user passes, the engine or model that boost built around it. A
`WeakKeyDictionary` cannot hold that: its value (an engine wrapping the optimizer it is keyed by) refers back to the
key, so the entry, the optimizer, its state and the model stay alive for the plugin's whole life. Here an entry
lives exactly while both its key and its value do, i.e. while the user still holds what boost returned.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["WeakLookup"]

K = TypeVar("K")
V = TypeVar("V")


class WeakLookup(Generic[K, V]):
    """A mapping from `key` to `value` that keeps neither alive."""

    def __init__(self) -> None:
        self._refs: weakref.WeakKeyDictionary[K, weakref.ref[V]] = weakref.WeakKeyDictionary()

    def __setitem__(self, key: K, value: V) -> None:
        self._refs[key] = weakref.ref(value)

    def get(self, key: K) -> V | None:
        """The value stored for `key`, or None when there is none or it has been freed."""
        ref = self._refs.get(key)
        return None if ref is None else ref()

    def items(self) -> Iterator[tuple[K, V]]:
        """The live entries (a snapshot, so callers may trigger collection while iterating)."""
        for key, ref in list(self._refs.items()):
            value = ref()
            if value is not None:
                yield key, value
