"""`trainer.json`, a cx-train checkpoint's record of the step reached and the run that wrote it: its fields, and
reading it back with an error that names the file and what is wrong (a truncated file, text after the object, a
missing, unknown or mistyped field) instead of a bare `JSONDecodeError` / `TypeError`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["STATE_FILE", "TrainerState", "TrainerStateError", "read_trainer_state"]

STATE_FILE = "trainer.json"


@dataclass(frozen=True)
class TrainerState:
    step: int
    plugin: str
    world_size: int
    model: str = "gpt"  # --model of the run that wrote it (checkpoints from before --model existed are the GPT's)
    hidden_size: int | None = None  # the built-in models' sizes (None for a model folder, which has its own)
    num_layers: int | None = None
    data_epoch: int | None = None  # --data: the epoch of the window order and the windows taken in it (_data_order)
    data_offset: int | None = None
    tokenizer: str | None = None  # the tokenizer's identity (models._tokenizer_files); None in older checkpoints
    optimizer: str | None = None  # --optimizer of the run that wrote it (None in older checkpoints: an Adam(W))


class TrainerStateError(ValueError):
    """`trainer.json` is missing or unreadable; the message names the file."""


# field -> (accepted types, may be None); bool is excluded from int below (json's true would pass isinstance)
_TYPES: dict[str, tuple[type, bool]] = {
    "step": (int, False),
    "plugin": (str, False),
    "world_size": (int, False),
    "model": (str, False),
    "hidden_size": (int, True),
    "num_layers": (int, True),
    "data_epoch": (int, True),
    "data_offset": (int, True),
    "tokenizer": (str, True),
    "optimizer": (str, True),
}
_REQUIRED = ("step", "plugin", "world_size")  # the rest have defaults (older checkpoints lack them)


def _field_problem(name: str, value: Any) -> str | None:
    kind, nullable = _TYPES[name]
    if value is None and nullable:
        return None
    if not isinstance(value, kind) or isinstance(value, bool):
        return f'"{name}" must be {"an integer" if kind is int else "a string"}, got {json.dumps(value)}'
    if isinstance(value, int) and value < 0:
        return f'"{name}" must not be negative, got {value}'
    return None


def read_trainer_state(directory: Path) -> TrainerState:
    """The `TrainerState` saved in `directory`, validated field by field."""
    path = directory / STATE_FILE
    if not path.is_file():
        raise TrainerStateError(f"{path}: no {STATE_FILE}; {directory} is not a complete cx-train checkpoint")
    try:
        saved = json.loads(path.read_text())
    except UnicodeDecodeError as error:
        raise TrainerStateError(f"{path}: not text ({error}); the file is damaged") from None
    except json.JSONDecodeError as error:
        raise TrainerStateError(
            f"{path}: not valid JSON ({error.msg} at line {error.lineno} column {error.colno}); "
            "the file is damaged (truncated or edited)"
        ) from None
    if not isinstance(saved, dict):
        raise TrainerStateError(f"{path}: expected a JSON object, got {type(saved).__name__}")
    unknown = sorted(set(saved) - set(_TYPES))
    if unknown:
        raise TrainerStateError(
            f"{path}: unknown field(s) {', '.join(unknown)} (cx-train writes {', '.join(_TYPES)}); "
            "the file is damaged or from another program"
        )
    missing = [name for name in _REQUIRED if name not in saved]
    if missing:
        raise TrainerStateError(f"{path}: missing field(s) {', '.join(missing)}")
    for name, value in saved.items():
        problem = _field_problem(name, value)
        if problem is not None:
            raise TrainerStateError(f"{path}: {problem}")
    return TrainerState(**saved)
