"""`MoeHybridParallelPlugin`: HybridParallelPlugin with experts over an ep axis (the family that extends another)."""

from cx_plugins.moe_hybrid._plugin import MoeHybridParallelPlugin

__all__ = ["MoeHybridParallelPlugin"]
