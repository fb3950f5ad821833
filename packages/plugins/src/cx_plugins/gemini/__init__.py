"""`GeminiPlugin`: cx-zero's Gemini (chunked ZeRO-3), with tensor parallelism and their checkpoint IOs."""

from cx_plugins.gemini._plugin import GeminiPlugin

__all__ = ["GeminiPlugin"]
