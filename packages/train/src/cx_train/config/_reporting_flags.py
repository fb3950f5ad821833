"""cx-train's flags for what a run writes besides the progress line (`--metrics`, `--tensorboard`), as one argument
group of `_parser`'s parser, and their check before any process starts."""

from __future__ import annotations

import argparse
from pathlib import Path

from cx_train.metrics._tensorboard import tensorboard_missing

__all__ = ["add_reporting_arguments", "reporting_problem"]


def add_reporting_arguments(parser: argparse.ArgumentParser) -> None:
    reporting = parser.add_argument_group("metrics and plots")
    reporting.add_argument(
        "--metrics",
        type=Path,
        default=None,
        help="write one JSON object per log step to this .jsonl file (appended on --resume) and, when matplotlib is "
        "installed, its curves to the same path with suffix .png at the end (default: none)",
    )
    reporting.add_argument(
        "--tensorboard",
        type=Path,
        default=None,
        help="write TensorBoard event files to this directory (needs the tensorboard package) (default: none)",
    )


def reporting_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with --metrics / --tensorboard (None when nothing is)."""
    metrics: Path | None = args.metrics
    if metrics is not None and metrics.is_dir():
        return f"--metrics {metrics} is a directory; give a file such as {metrics / 'metrics.jsonl'}"
    tensorboard: Path | None = args.tensorboard
    if tensorboard is not None and tensorboard.exists() and not tensorboard.is_dir():
        return f"--tensorboard {tensorboard} is a file; give a directory for the event files"
    return None if tensorboard is None else tensorboard_missing()
