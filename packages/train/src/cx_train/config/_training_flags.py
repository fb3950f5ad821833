"""cx-train's optimisation flags (schedule, weight decay, accumulation, clipping, activation checkpointing, compile)
and the config-file flags, as one argument group each of `_parser`'s parser; what they mean together is checked in
`_training_checks`."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

__all__ = ["LR_SCHEDULES", "add_training_arguments"]

LR_SCHEDULES = ("constant", "linear", "cosine")


def _count(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    training = parser.add_argument_group("optimisation")
    training.add_argument(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        default="constant",
        help="learning-rate curve after the warm-up: constant, linear decay to 0 or cosine decay to 0 at --steps",
    )
    training.add_argument(
        "--warmup-steps", type=lambda t: _count(t, 0), default=0, help="steps of linear warm-up from lr/N to --lr"
    )
    training.add_argument(
        "--weight-decay", type=_non_negative_float, default=0.0, help="AdamW's decoupled weight decay"
    )
    training.add_argument(
        "--grad-accum",
        type=lambda t: _count(t, 1),
        default=1,
        help="micro-batches of --batch-size per optimizer step (gradients averaged; no communication but on the "
        "last): the same step as one batch N times larger",
    )
    training.add_argument(
        "--clip", type=_non_negative_float, default=0.0, help="clip the global gradient norm to this, 0 for off"
    )
    training.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each layer's activations in the backward (less memory, ~1/3 more compute); transformers "
        "models only (default: off)",
    )
    training.add_argument(
        "--activation-checkpointing-mode",
        choices=("full", "selective-op"),  # cx_plugins._activation_checkpointing.CHECKPOINT_MODES (no torch here)
        default="full",
        help="what a checkpointed layer keeps: full recomputes all of it; selective-op keeps the outputs torchtitan's "
        "op policy saves (every other matmul, attention) and recomputes the rest, and turns checkpointing on; not "
        "with --plugin hybrid / moe_hybrid, which checkpoint whole layers through ShardFormer",
    )
    training.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model in place; --plugin torch_ddp only (default: off)",
    )
    training.add_argument(
        "--compile-backend",
        default="inductor",
        metavar="NAME",
        help="torch.compile backend for --compile: inductor generates kernels; aot_eager traces and runs the same "
        "graphs without code generation, which starts in seconds (default: inductor)",
    )
    config = parser.add_argument_group("config file")
    config.add_argument(
        "--config",
        type=Path,
        default=None,
        help="TOML file of flag values (keys are the flag names, - or _); flags given here override it (default: none)",
    )
    config.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config, which rank holds which parallel coordinates, the parameter / memory "
        "figures per rank and cx-plan's step-time prediction, then exit without training (default: off)",
    )
    config.add_argument(
        "--plan", dest="dry_run", action="store_true", help="the same as --dry-run (cx-plan's name) (default: off)"
    )
