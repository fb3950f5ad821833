"""`--resume` checked against this run's model before any process starts, or every rank would start, load and fail
with a tensor-shape traceback: a transformers model's shape settings in the checkpoint's saved `model/config.json`,
then every saved tensor's shape (a learned position table follows `--seq-len`). The built-in models' `--model`,
`--hidden-size` and `--num-layers` are in `trainer.json`, checked by `_paths`."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cx_train.models._tokenizer_files import TokenizerIdentity

__all__ = [
    "DECAYING_SCHEDULES",
    "adapter_problem",
    "embedded_text_message",
    "resumed_model_problem",
    "resumed_run_problem",
    "saved_run_config",
    "schedule_note",
    "tokenizer_problem",
]

DECAYING_SCHEDULES = ("linear", "cosine")  # --lr-schedule curves that end at --steps
_RUN_FLAGS = ("seq_len", "seed")  # what a resumed run must share with the checkpoint's (its data windows and order)

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
_SIZE_FLAGS = ("model", "seq_len", "hidden_size", "num_layers")  # what a hint compares with the checkpoint's run


def embedded_text_message(resume: Path, model: str) -> str:
    """The refusal of a checkpoint trained on the embedded text resumed with `--data` read as UTF-8 bytes."""
    return (
        f"--resume {resume}: that checkpoint was trained on the embedded text, whose model reads the built-in "
        f"character ids; --data with --model {model} reads UTF-8 bytes (another vocabulary): start a new run on "
        "--data, or resume without --data"
    )


def _config_problem(resume: Path, model: str, config: Any) -> str | None:
    try:
        saved = json.loads((resume / "model" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or config is None:
        return None
    for field in _SHAPE_FIELDS:
        trained, wanted = saved.get(field), getattr(config, field, None)
        if trained is not None and wanted is not None and trained != wanted:
            return (
                f"--resume {resume}: the checkpoint's model has {field} {trained}, but --model {model} has "
                f"{wanted}; resume with the model it was trained with"
            )
    return None


def saved_run_config(resume: Path) -> dict[str, Any]:
    """The checkpoint's resolved `config.toml` (empty for a checkpoint without one, or an unreadable one: the
    checksums the verification checks first catch a damaged file)."""
    try:
        return tomllib.loads((resume / "config.toml").read_text())
    except (OSError, ValueError):
        return {}


def resumed_run_problem(resume: Path, flags: Mapping[str, object]) -> str | None:
    """Why this run's --seq-len or --seed (in `flags`) cannot continue the checkpoint's run: its windows and its data
    order follow from them, so another value trains on other data than the checkpoint's position says."""
    saved = saved_run_config(resume)
    for name in _RUN_FLAGS:
        trained, given = saved.get(name), flags[name]
        if trained is not None and trained != given:
            flag = "--" + name.replace("_", "-")
            return (
                f"--resume {resume}: the checkpoint's run had {flag} {trained}, this run has {flag} {given}; "
                f"resume with {flag} {trained} (or start a new run)"
            )
    return None


def adapter_problem(resume: Path, rank: int, alpha: int) -> str | None:
    """Why this run's --lora-rank / --lora-alpha are not those of the checkpoint's adapters (peft's
    adapter_config.json), which a resume loads as they are."""
    try:
        saved = json.loads((resume / "adapter" / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None
    for flag, key, given in (("--lora-rank", "r", rank), ("--lora-alpha", "lora_alpha", alpha)):
        trained = saved.get(key) if isinstance(saved, dict) else None
        if trained is not None and trained != given:
            return (
                f"--resume {resume}: the checkpoint's adapters have {flag} {trained}, this run has {flag} {given}; "
                f"resume with {flag} {trained}"
            )
    return None


def tokenizer_problem(resume: Path, trained: str | None, given: str, model: str) -> str | None:
    """Why the checkpoint's tokenizer (`trained`, its recorded identity) is not this run's (`given`): the same ids
    would be other text."""
    if trained is None or trained == given:
        return None
    was, now = TokenizerIdentity(trained), TokenizerIdentity(given)
    same = " (the same vocabulary size, other tokens)" if was.vocab_size == now.vocab_size else ""
    return (
        f"--resume {resume}: the checkpoint was trained with a {was.describe()}, but --model {model} has a "
        f"{now.describe()}{same}; resume with the model folder it was trained with, e.g. --model {resume / 'model'}"
    )


def schedule_note(resume: Path, schedule: str, steps: int) -> str | None:
    """The log line of a resume under a decaying schedule with another --steps: the curve is rebuilt over the new
    total (cx-train's choice, documented in docs/training.md), so the rate moves to the new curve at once."""
    saved = saved_run_config(resume).get("steps")
    if schedule not in DECAYING_SCHEDULES or saved is None or saved == steps:
        return None
    return (
        f"cx-train: --steps {steps} is not the checkpoint's run's {saved}: the {schedule} learning-rate curve is "
        f"rebuilt to end at step {steps}, and the rate moves onto it from the resumed step"
    )


def _differing_flags(resume: Path, flags: Mapping[str, object]) -> str:
    """The size flags whose value in the checkpoint's resolved config.toml is not this run's, as a hint."""
    try:
        saved = tomllib.loads((resume / "config.toml").read_text())
    except (OSError, ValueError):
        return ""
    differing = [
        f"--{name.replace('_', '-')} {saved[name]}"
        for name in _SIZE_FLAGS
        if saved.get(name, flags[name]) != flags[name]
    ]
    return f" (its run had {', '.join(differing)})" if differing else ""


def resumed_model_problem(
    resume: Path,
    flags: Mapping[str, object],
    config: Any,
    saved: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
) -> str | None:
    """Why the checkpoint in `resume` does not fit this run's model (None when it fits): `flags` are this run's
    model, seq_len, hidden_size and num_layers, `config` its transformers config (None for the GPT), `saved` the
    checkpoint's tensor shapes and `expected` the model's."""
    problem = _config_problem(resume, str(flags["model"]), config)
    if problem is not None:
        return problem
    for name, shape in saved.items():
        wanted = expected.get(name)
        if wanted is not None and wanted != shape:
            return (
                f"--resume {resume}: the checkpoint's {name} is {list(shape)}, this run's model has {list(wanted)}"
                f"{_differing_flags(resume, flags)}; resume with the sizes it was trained with"
            )
    return None
