"""The demo's command line, parsed once into a frozen `DemoOptions`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PLUGINS", "DemoOptions", "parse_options"]

PLUGINS = ("gemini", "low_level_zero", "torch_ddp", "hybrid")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class DemoOptions:
    plugin: str
    nproc: int
    steps: int
    batch_size: int
    seq_len: int
    hidden_size: int
    num_layers: int
    lr: float
    precision: str
    seed: int
    log_every: int
    save: Path | None
    save_every: int
    resume: Path | None
    tp: int = 1
    pp: int = 1


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cx-train",
        description="Train cx's reference GPT on an embedded text dataset with a chosen plugin on N local processes.",
    )
    parser.add_argument(
        "--plugin", choices=PLUGINS, default=PLUGINS[0], help="parallel strategy (default: %(default)s)"
    )
    parser.add_argument("--nproc", type=_positive, default=2, help="processes on this machine (default: %(default)s)")
    parser.add_argument("--steps", type=_positive, default=200, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=_positive, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=_positive, default=64, help="characters per sequence")
    parser.add_argument("--hidden-size", type=_positive, default=128)
    parser.add_argument("--num-layers", type=_positive, default=2)
    parser.add_argument("--lr", type=_positive_float, default=1e-3)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--seed", type=int, default=1024)
    parser.add_argument("--log-every", type=_positive, default=10, help="steps between progress lines")
    parser.add_argument("--save", type=Path, default=None, help="checkpoint directory (written at the end)")
    parser.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps (needs --save)")
    parser.add_argument("--resume", type=Path, default=None, help="continue from a cx-train checkpoint directory")
    parser.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size (--plugin hybrid)")
    parser.add_argument("--pp", type=_positive, default=1, help="pipeline stages (--plugin hybrid)")
    return parser


def parse_options(argv: Sequence[str] | None = None) -> DemoOptions:
    args = build_parser().parse_args(argv)
    parser = build_parser()
    if args.hidden_size % 4:
        parser.error(f"--hidden-size must be a multiple of 4 (the model has 4 heads), got {args.hidden_size}")
    if args.save_every < 0 or (args.save_every and args.save is None):
        parser.error("--save-every needs --save DIR and a non-negative step count")
    if args.resume is not None and not (args.resume / "trainer.json").is_file():
        parser.error(f"--resume {args.resume}: not a complete cx-train checkpoint (no trainer.json)")
    if (args.tp > 1 or args.pp > 1) and args.plugin != "hybrid":
        parser.error(f"--tp/--pp need --plugin hybrid (got --plugin {args.plugin})")
    if args.plugin == "hybrid":
        if args.nproc % (args.tp * args.pp):
            parser.error(f"--nproc {args.nproc} is not divisible by --tp {args.tp} x --pp {args.pp}")
        if args.num_layers < args.pp:
            parser.error(f"--num-layers {args.num_layers} is fewer than the --pp {args.pp} stages")
        if args.save is not None or args.resume is not None:
            parser.error("--save/--resume with --plugin hybrid: its checkpoint IO has not landed yet")
    return DemoOptions(
        plugin=args.plugin,
        nproc=args.nproc,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        lr=args.lr,
        precision=args.precision,
        seed=args.seed,
        log_every=args.log_every,
        save=args.save,
        save_every=args.save_every,
        resume=args.resume,
        tp=args.tp,
        pp=args.pp,
    )
