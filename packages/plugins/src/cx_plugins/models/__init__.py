"""Reference models for tests, benchmarks and the demo, with deterministic initialisation."""

from cx_plugins.models._gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
