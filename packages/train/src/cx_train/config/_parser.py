"""cx-train's flags: their value types, defaults and help (every flag shows its default). Built without importing
torch or cx-plugins, so that `--help` and a flag error answer at once (`_arguments` reads the command line with it);
what the values mean together is checked in `_options`."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from cx_train.checkpoint._verification import VERIFY_COST
from cx_train.config._data_flags import add_data_arguments
from cx_train.config._launch_flags import add_launch_arguments
from cx_train.config._plugin_flags import add_plugin_arguments
from cx_train.config._reporting_flags import add_reporting_arguments
from cx_train.config._training_flags import add_training_arguments
from cx_train.models._names import GPT_MODEL, MODEL_CHOICES

__all__ = [
    "DEFAULT_HIDDEN",
    "DEFAULT_LAYERS",
    "DEFAULT_TIMEOUT_S",
    "HYBRID_CLASSES",
    "PLUGINS",
    "PP_STYLES",
    "PRECISIONS",
    "build_parser",
]

HYBRID_CLASSES = {"hybrid": "HybridParallelPlugin", "moe_hybrid": "MoeHybridParallelPlugin"}
PLUGINS = ("gemini", "low_level_zero", "torch_ddp", "torch_fsdp", *HYBRID_CLASSES)
PRECISIONS = ("fp32", "bf16", "fp16")
PP_LAYER_SPLITS = ("even", "balanced")  # the plugins' num_layers_per_stage=None / "balanced"
PP_STYLES = ("1f1b", "interleaved", "zbv")  # zbv: the zero-bubble V schedule, two chunks per stage
DEFAULT_HIDDEN, DEFAULT_LAYERS = 128, 2
DEFAULT_TIMEOUT_S = 600.0  # cx_mesh.DEFAULT_TIMEOUT (10 minutes), without importing torch; a test asserts they agree
_USAGE = "%(prog)s [--FLAG VALUE ...]  (--help lists every flag and its default)"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not math.isfinite(value):  # inf and nan parse as floats, and train to a NaN loss
        raise argparse.ArgumentTypeError(f"must be a finite positive number, got {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value:g}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag shows its default: argparse's own "(default: X)", unless the help already says it (the flags
    whose real default depends on others, or that default to None to tell "not given" apart)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "(default" in action.help:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cx-train",
        usage=_USAGE,  # argparse's own lists every flag: 24 lines above each one-line error
        description="Train a language model on an embedded text dataset with a chosen plugin on N local processes.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--plugin", choices=PLUGINS, default=PLUGINS[0], help="parallel strategy")
    parser.add_argument(
        "--model",
        default=GPT_MODEL,
        metavar="{" + ",".join(MODEL_CHOICES) + "} or DIR",
        help="cx's reference GPT, a tiny transformers preset built from a config (no download), "
        "or a local transformers model folder (config.json and weights; its tokenizer when present)",
    )
    parser.add_argument(
        "--nproc", type=_positive, default=2, help="processes on this machine (with --nnodes: on each machine)"
    )
    parser.add_argument(
        "--steps",
        type=_positive,
        default=200,
        help="optimizer steps to reach: with --resume, the total including the checkpoint's steps, not the steps "
        "to add",
    )
    parser.add_argument("--batch-size", type=_positive, default=8, help="sequences per data-parallel rank per step")
    parser.add_argument("--seq-len", type=_positive, default=64, help="tokens per sequence")
    parser.add_argument(
        "--hidden-size", type=_positive, default=None, help=f"built-in models (default: {DEFAULT_HIDDEN})"
    )
    parser.add_argument(
        "--num-layers", type=_positive, default=None, help=f"built-in models (default: {DEFAULT_LAYERS})"
    )
    parser.add_argument("--lr", type=_positive_float, default=1e-3, help="AdamW learning rate (finite, positive)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32", help="parameter / compute precision")
    parser.add_argument("--seed", type=_integer, default=1024, help="seed of the weights and of the data order")
    parser.add_argument("--log-every", type=_positive, default=10, help="steps between progress lines")
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds a rank waits for a peer that is alive but stuck (a collective or a pipeline transfer) before "
        "failing with an error naming the group; a peer that raised or died stops the run within seconds",
    )
    parser.add_argument(
        "--save", type=Path, default=None, help="checkpoint directory, written at the end (default: none)"
    )
    parser.add_argument(
        "--save-every",
        type=_integer,
        default=0,
        help="also checkpoint every N steps, written in the background while training goes on; 0 for never (needs "
        "--save)",
    )
    parser.add_argument(
        "--resume", type=Path, default=None, help="continue from a cx-train checkpoint directory (default: none)"
    )
    parser.add_argument(
        "--max-restarts",
        type=_integer,
        default=0,
        help="when a rank dies or a collective fails, restart the ranks and resume from the latest checkpoint in "
        "--save, up to N times (needs --save)",
    )
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="--resume without first checking every shard against the checksums recorded at save time "
        f"(default: verify; {VERIFY_COST})",
    )
    hybrid = parser.add_argument_group("hybrid parallelism (--plugin hybrid / moe_hybrid; --tp also gemini)")
    hybrid.add_argument(
        "--tp",
        type=_positive,
        default=None,
        help="tensor-parallel size; also --plugin gemini's tp_size (ShardFormer over tp, Gemini over the rest) "
        "(default: 1)",
    )
    hybrid.add_argument("--pp", type=_positive, default=None, help="pipeline stages (default: 1)")
    hybrid.add_argument("--ep", type=_positive, default=None, help="expert-parallel size, moe_hybrid (default: 1)")
    hybrid.add_argument(
        "--sp",
        type=_positive,
        default=None,
        help="sequence-parallel axis size, all_to_all / ring_attn (--sp-mode) (default: 1)",
    )
    hybrid.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2),
        default=None,
        help="ZeRO stage (default: 0; low_level_zero: 1 or 2, default 2)",
    )
    hybrid.add_argument(
        "--microbatches", type=_positive, default=None, help="micro-batches per step with --pp (default: --pp)"
    )
    hybrid.add_argument("--pp-style", choices=PP_STYLES, default=None, help="pipeline schedule (default: 1f1b)")
    hybrid.add_argument(
        "--pp-layers",
        choices=PP_LAYER_SPLITS,
        default=None,
        help="layers per stage: even by count or balanced by cost (the head counted at its size; cx-plan predicts "
        "the even split) (default: even)",
    )
    add_plugin_arguments(parser)
    add_data_arguments(parser)
    add_training_arguments(parser)
    add_reporting_arguments(parser)
    add_launch_arguments(parser)
    return parser
