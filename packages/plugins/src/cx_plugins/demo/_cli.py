"""`cx-train`: start N local ranks through torch's elastic launcher (torchrun), or act as one rank under it."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch.distributed as dist

from cx_plugins.demo._options import parse_options

__all__ = ["main"]


def _run_rank(argv: Sequence[str]) -> int:
    from cx_plugins.demo._train import train

    options = parse_options(argv)
    losses = train(options)
    if dist.get_rank() == 0 and len(losses) >= 20:
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        print(f"cx-train: loss {first:.3f} -> {last:.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        code = _run_rank(arguments)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: torch 2.13 CPU can abort there after a clean run
    options = parse_options(arguments)  # validate flags before starting any process
    from torch.distributed.run import main as torchrun

    launcher = ["--standalone", "--nproc_per_node", str(options.nproc), "-m", "cx_plugins.demo", *arguments]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torchrun(launcher)
    return 0
