"""Lazy initialisation: `LazyInitContext` records a model's construction on a tape without allocating it; the
plugins replay it parameter by parameter straight into their shards (tensor-parallel slices, FSDP shards, Gemini
chunks)."""

from cx_plugins.lazy._context import LazyInitContext, is_compatible_with_meta

__all__ = ["LazyInitContext", "is_compatible_with_meta"]
