"""The built-in model names `cx-train --model` and `cx-plan --model` accept: the reference GPT and the Hugging Face
presets (tiny configs of each architecture family cx trains), kept in one place so the trainer and the planner offer
the same list."""

from __future__ import annotations

__all__ = ["GPT_MODEL", "MODEL_CHOICES", "PRESETS"]

GPT_MODEL = "gpt"
PRESETS = ("gpt2", "llama", "mixtral", "qwen3_moe", "deepseek_v3")
MODEL_CHOICES = (GPT_MODEL, *PRESETS)
