"""The one error type for bad pipeline configurations, so callers (and tests) can tell them from model bugs."""

from __future__ import annotations

__all__ = ["PipelineConfigError"]


class PipelineConfigError(ValueError):
    """A pipeline configuration that cannot run: raised on every rank, before any communication it would break."""
