"""The built-in `--model` names, as cx-plugins' `cx_plugins.models` lists them, held here without importing torch
so that `--help` and the flag checks run before any heavy import; a test asserts the two lists agree."""

from __future__ import annotations

__all__ = ["GPT_MODEL", "MODEL_CHOICES", "PRESETS"]

GPT_MODEL = "gpt"
PRESETS = ("gpt2", "llama", "mixtral", "qwen3_moe", "deepseek_v3")
MODEL_CHOICES = (GPT_MODEL, *PRESETS)
