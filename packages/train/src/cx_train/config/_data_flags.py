"""cx-train's data flags (`--data`, `--text-field`, `--eval-data`, `--eval-fraction`, `--eval-every`,
`--data-cache-dir`, `--tokenize-workers`, `--overlong`) as one argument group of `_parser`'s parser, their
combinations checked, and the `DataSettings` they make."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imports torch: only the validated options need it, after the flags are read
    from cx_train.data._user_data import DataSettings

__all__ = ["add_data_arguments", "data_problem", "data_settings"]


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number between 0 and 1, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("data (default: the embedded grammar text)")
    data.add_argument(
        "--data",
        nargs="+",
        default=None,
        metavar="FILE",
        help="train on these files or globs: plain text (a file is a document), JSON Lines (.jsonl/.json), Parquet "
        "(.parquet) or a datasets.save_to_disk folder; tokenised once with the model folder's tokenizer (UTF-8 "
        "bytes for the built-in models) and cached beside the data (default: none)",
    )
    data.add_argument("--text-field", default="text", help="the JSON Lines field / Parquet or dataset column")
    data.add_argument(
        "--overlong",
        choices=("error", "truncate", "drop"),
        default="error",
        help="a chat record longer than the window (--seq-len + 1 tokens): refuse it, keep its first tokens or "
        "leave it out; the data line counts what was truncated or dropped (default: error)",
    )
    data.add_argument("--eval-data", nargs="+", default=None, metavar="FILE", help="evaluation files (default: none)")
    data.add_argument(
        "--eval-fraction", type=_fraction, default=0.0, help="hold out this fraction of --data's windows for eval"
    )
    data.add_argument("--eval-every", type=_count, default=0, help="steps between evaluations, 0 for only at the end")
    data.add_argument(
        "--data-cache-dir",
        type=Path,
        default=None,
        help="where the token cache goes when the data's folder is not writable (default: ~/.cache/cx/tokens)",
    )
    data.add_argument(
        "--tokenize-workers",
        type=_count,
        default=1,
        help="processes that tokenise (a fast tokenizer already encodes a batch on all cores)",
    )


def data_problem(args: argparse.Namespace) -> str | None:
    evaluated = bool(args.eval_data) or args.eval_fraction > 0
    if args.data is None and (evaluated or args.eval_every):
        return "--eval-data, --eval-fraction and --eval-every need --data"
    if args.eval_data and args.eval_fraction > 0:
        return "--eval-data and --eval-fraction exclude each other: give one evaluation set"
    if args.eval_every and not evaluated:
        return "--eval-every needs --eval-data FILE or --eval-fraction F"
    if evaluated and (args.pp or 1) > 1:
        return "evaluation (--eval-data / --eval-fraction) with --pp is not supported yet; use --pp 1"
    return None


def data_settings(args: argparse.Namespace) -> DataSettings | None:
    if args.data is None:
        return None
    from cx_train.data._user_data import DataSettings

    return DataSettings(
        data=tuple(args.data),
        text_field=args.text_field,
        eval_data=tuple(args.eval_data or ()),
        eval_fraction=args.eval_fraction,
        cache_dir=args.data_cache_dir,
        workers=max(1, args.tokenize_workers),
        overlong=args.overlong,
    )
