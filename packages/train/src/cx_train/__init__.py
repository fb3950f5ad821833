"""cx-train: the trainer. A language model (cx's reference GPT, a tiny transformers preset, a local transformers
model folder or a bare config.json) trained on the embedded text or the user's own data with any cx plugin, on N
local processes or several nodes, with evaluation, exact resume, config files and metrics.

Laid out by concern, like torchtitan's trainer: the entry point (`_cli.py`: launcher and rank) and the training loop
(`_train.py`) at the top; `config/` (flags, config files, the validated `TrainOptions`), `data/`, `models/` (the
model and its plugin), `step/` (optimizer, schedule, accumulation, evaluation), `checkpoint/`, `metrics/` (progress
line, metrics file, TensorBoard, plots) in folders; `--dry-run` / `--plan` ask cx-plan (`_dry_run.py`).

The names below are imported on first use (PEP 562), so that `python -m cx_train --help` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cx_train._cli import main
    from cx_train.config._options import TrainOptions, parse_options
    from cx_train.data._grammar import CharTokenizer, GrammarText, TextEncoder, TokenWindows

_HOMES = {
    "main": "cx_train._cli",
    "TrainOptions": "cx_train.config._options",
    "parse_options": "cx_train.config._options",
    **dict.fromkeys(("CharTokenizer", "GrammarText", "TextEncoder", "TokenWindows"), "cx_train.data._grammar"),
}


def __getattr__(name: str) -> Any:
    """`cx_train.X`: imported from its module on first use."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'cx_train' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


__all__ = ["CharTokenizer", "GrammarText", "TextEncoder", "TokenWindows", "TrainOptions", "main", "parse_options"]
