"""Checks on `--save`, `--resume` and the other paths a run writes, made before any process starts, so that a run
does not train for an hour and then fail to save, or start, do nothing and exit as if it had trained."""

from __future__ import annotations

import os
from pathlib import Path

from cx_train.checkpoint._trainer_state import TrainerStateError, read_trainer_state
from cx_train.models._names import MODEL_CHOICES

__all__ = ["outputs_problem", "resume_problem", "save_problem", "writable_problem"]


def _nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists (what `mkdir(parents=True)` would create below)."""
    absolute = path.absolute()
    for candidate in (absolute, *absolute.parents):
        if candidate.exists():
            return candidate
    return Path(absolute.anchor)


def writable_problem(flag: str, path: Path, inside: bool, what: str) -> str | None:
    """Why `path` cannot be written (None when it can): a file or folder created at `path`, or with `inside`, files
    created in the folder `path`. The nearest existing folder on the way must be a directory this process may write
    in; `what` names the thing for the message."""
    parent = _nearest_existing(path if inside else path.parent)
    if not parent.is_dir():
        return f"{flag} {path}: {parent} is not a directory, so the {what} cannot be created under it"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag} {path}: cannot write in {parent} (permission denied); choose a writable path"
    return None


def save_problem(save: Path) -> str | None:
    """Why a checkpoint cannot be written to `save` (None when it can): the save writes a staging sibling of
    `save` and renames it over `save`, so `save` must be a directory or not exist, and its parent writable."""
    if save.exists() and not save.is_dir():
        return f"--save {save}: exists and is not a directory (a checkpoint is a directory); choose another path"
    return writable_problem("--save", save, False, "checkpoint")


def outputs_problem(metrics: Path | None, tensorboard: Path | None, cache_dir: Path | None) -> str | None:
    """Why `--metrics`, `--tensorboard` or `--data-cache-dir` cannot be written, checked before any process starts
    as `--save` is (the ranks used to find out after starting; the token cache with a bare OSError)."""
    for flag, path, inside, what in (
        ("--metrics", metrics, False, "metrics file"),
        ("--tensorboard", tensorboard, True, "event files"),
        ("--data-cache-dir", cache_dir, True, "token cache"),
    ):
        problem = None if path is None else writable_problem(flag, path, inside, what)
        if problem is not None:
            return problem
    return None


def resume_problem(resume: Path, model: str, sizes: dict[str, int], steps: int, optimizer: str = "adamw") -> str | None:
    """Why `--resume resume` cannot continue this run (None when it can): the folder, its trainer.json, the model
    it holds (`model` and the built-in model's `sizes` by flag name), the step it reached against `--steps`, and
    its optimizer state's kind against `--optimizer` (the Adam(W)s share one layout; muon's groups and state
    differ)."""
    if not resume.exists():
        return f"--resume {resume}: no such directory"
    if not resume.is_dir():
        return f"--resume {resume}: not a directory (a cx-train checkpoint is a directory)"
    try:
        saved = read_trainer_state(resume)
    except TrainerStateError as error:
        return f"--resume {resume}: {error}"
    trained = saved.model
    if trained != model and (trained in MODEL_CHOICES or model in MODEL_CHOICES):
        return f"--resume {resume}: the checkpoint is of --model {trained}, not {model}; pass --model {trained}"
    for flag, given in sizes.items():
        wanted = getattr(saved, flag.removeprefix("--").replace("-", "_"))
        if wanted is not None and wanted != given:
            return f"--resume {resume}: the checkpoint's model has {flag} {wanted}, not {given}; pass it"
    trained_with = saved.optimizer or "adamw"  # older checkpoints: one of the Adam(W)s (muon did not exist)
    if (trained_with == "muon") != (optimizer == "muon"):
        return (
            f"--resume {resume}: the checkpoint's optimizer state is --optimizer {trained_with}'s, which --optimizer "
            f"{optimizer} cannot load (Muon keeps a momentum per matrix in two param groups, Adam two moments in "
            f"one); pass --optimizer {trained_with}"
        )
    if saved.step >= steps:
        return (
            f"--resume {resume}: the checkpoint is already at step {saved.step} >= --steps {steps}, so there is "
            f"nothing to train; --steps is the total to reach, not the steps to add (e.g. --steps {saved.step + steps})"
        )
    return None
