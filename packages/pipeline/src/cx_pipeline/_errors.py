"""The pipeline's own errors: bad configurations, so callers (and tests) can tell them from model bugs, and a data
iterator with no batch left for the step."""

from __future__ import annotations

__all__ = ["EmptyDataIterError", "PipelineConfigError"]


class PipelineConfigError(ValueError):
    """A pipeline configuration that cannot run: raised on every rank, before any communication it would break."""


class EmptyDataIterError(StopIteration):
    """The step's data iterator had no batch left. A StopIteration, as ColossalAI's bare one is, so a loop that ends
    its epoch on StopIteration keeps working; but it says what ran dry and what to pass instead."""
