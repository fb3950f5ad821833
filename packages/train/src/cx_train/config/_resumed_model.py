"""`--resume` of a transformers model checked against this run's `--model` before any process starts: the shape
settings in the checkpoint's saved `model/config.json` must be this run's, or every rank would start, load and fail
with a tensor-shape traceback. (The built-in models' sizes are in `trainer.json`, checked by `_paths`.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["resumed_model_problem"]

# the config fields that set a parameter's shape or count (vocab_size is left out: the tokenizer may extend it)
_SHAPE_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
)


def resumed_model_problem(resume: Path, model: str, config: Any) -> str | None:
    """Why the checkpoint in `resume` does not fit the model of `--model model` with transformers config `config`
    (None when it fits, or when the checkpoint keeps no readable `model/config.json` to compare with)."""
    try:
        saved = json.loads((resume / "model" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict):
        return None
    for field in _SHAPE_FIELDS:
        trained, wanted = saved.get(field), getattr(config, field, None)
        if trained is not None and wanted is not None and trained != wanted:
            return (
                f"--resume {resume}: the checkpoint's model has {field} {trained}, but --model {model} has "
                f"{wanted}; resume with the model it was trained with"
            )
    return None
