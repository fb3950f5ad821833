"""`cx-train`: start N local ranks through torch's elastic launcher (torchrun), or act as one rank under it."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

import torch.distributed as dist

from cx_plugins.demo._options import parse_options

__all__ = ["main"]


def _run_rank(argv: Sequence[str]) -> int:
    from cx_plugins.demo._train import train

    options = parse_options(argv, world_size=int(os.environ["WORLD_SIZE"]))  # the layout of the real world
    losses = train(options)
    if dist.get_rank() == 0 and len(losses) >= 20:
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        print(f"cx-train: loss {first:.3f} -> {last:.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


_ARGS_VARIABLE = "CX_TRAIN_ARGS"  # flags travel to the ranks here: torchrun's own parser would claim some of them


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if _ARGS_VARIABLE in os.environ and not arguments:
            arguments = json.loads(os.environ[_ARGS_VARIABLE])
        code = _run_rank(arguments)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: torch 2.13 CPU can abort there after a clean run
    options = parse_options(arguments)  # validate flags before starting any process
    from torch.distributed.run import main as torchrun

    launcher = ["--standalone", "--nproc_per_node", str(options.nproc), "-m", "cx_plugins.demo"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[_ARGS_VARIABLE] = json.dumps(arguments)
    torchrun(launcher)
    return 0
