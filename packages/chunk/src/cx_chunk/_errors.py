"""Errors raised by cx-chunk: one base class so callers can catch everything chunk-related at once."""

from __future__ import annotations

__all__ = ["BudgetError", "ChunkError", "ChunkFullError", "IllegalTransitionError"]


class ChunkError(RuntimeError):
    """A chunk operation was asked for in a state where it cannot be done."""


class ChunkFullError(ChunkError):
    """A tensor does not fit in the remaining space of a chunk."""


class IllegalTransitionError(ChunkError):
    """A tensor was moved between two states the transition table does not connect."""


class BudgetError(ChunkError):
    """A placement policy cannot fit what one operation period needs into the device budget."""
