"""`cx-train`: start N local ranks through torch's elastic launcher (torchrun), or act as one rank under it.

Before any process starts, the flags are validated and a `--resume` checkpoint verified. Ctrl-C stops the run
cleanly: the launcher passes SIGINT on to the ranks once (later ones are ignored while they stop), the ranks stop
together at the next step boundary and rank 0 prints one line (the step reached, what was saved); any staging
directory of an unfinished save is removed. Exit status: 0 trained, 2 refused flags or checkpoint (nothing ran),
130 interrupted.

`cx-train plot FILE.jsonl [-o OUT.png]` draws a `--metrics` file instead of training.

torch, cx-plugins and the data are imported only once the flags are read (`config._arguments`), so `--help` and a
flag error answer in well under a second instead of after seconds of imports.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

from cx_train.config._arguments import parse_arguments

if TYPE_CHECKING:
    from cx_train.config._options import TrainOptions

__all__ = ["main"]

INTERRUPTED = 128 + signal.SIGINT  # the shell's status of a process stopped by Ctrl-C


def _run_rank(argv: Sequence[str], launched_here: bool) -> int:
    import torch.distributed as dist

    from cx_checkpoint import remove_stale_staging
    from cx_train._dry_run import dry_run_report
    from cx_train._launcher_watch import exit_with_parent
    from cx_train._train import train
    from cx_train.checkpoint._restart import restarted
    from cx_train.config._options import parse_options
    from cx_train.metrics._progress import loss_summary
    from cx_train.step._interrupt import Interrupted, install_stop_handler

    install_stop_handler()
    exit_with_parent(f"rank {os.environ['RANK']}")  # a launcher killed with SIGKILL takes its ranks with it
    world_size = int(os.environ["WORLD_SIZE"])
    options = restarted(parse_options(argv, world_size=world_size), world_size)  # the real world's layout
    if options.dry_run:  # under an outside torchrun: rank 0 reports the real world's layout
        if os.environ["RANK"] == "0":
            print(dry_run_report(options, world_size), end="", flush=True)
        return 0
    if not launched_here and not _verified(options):  # under an outside torchrun, no launcher verified it
        return 2
    try:
        losses = train(options)
    except Interrupted as stopped:
        if dist.get_rank() == 0:
            if options.save is not None:
                remove_stale_staging(options.save)
            print(f"cx-train: {stopped}", file=sys.stderr, flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return INTERRUPTED
    summary = loss_summary(losses)
    if dist.get_rank() == 0 and summary is not None:
        print(summary, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _verified(options: TrainOptions) -> bool:
    """Verify a `--resume` checkpoint unless `--no-verify`; prints the problem and returns False when it fails."""
    if options.resume is None or not options.verify:
        return True
    from cx_train.checkpoint._verification import verification_problem

    problem = verification_problem(options.resume)
    if problem is not None:
        print(f"cx-train: error: {problem}", file=sys.stderr, flush=True)
    return problem is None


def _stop_once(signum: int, frame: FrameType | None) -> None:
    """The launcher's SIGINT: torch's agent passes it on to the ranks and waits for them (SignalException); a second
    Ctrl-C while they stop is ignored (the agent still kills ranks that do not stop within its shutdown timeout)."""
    from torch.distributed.elastic.multiprocessing import SignalException

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in list(logging.root.manager.loggerDict):  # its warnings about the shutdown it is asked for
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    raise SignalException("cx-train: interrupted", sigval=signal.Signals(signum))


_ARGS_VARIABLE = "CX_TRAIN_ARGS"  # flags travel to the ranks here: torchrun's own parser would claim some of them


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["plot"]:  # `cx-train plot FILE.jsonl`: no training flag is a bare word, so no clash
        from cx_train.metrics._plot import plot_main

        return plot_main(arguments[1:])
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        launched_here = _ARGS_VARIABLE in os.environ
        if launched_here and not arguments:
            arguments = json.loads(os.environ[_ARGS_VARIABLE])
        code = _run_rank(arguments, launched_here)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: torch 2.13 CPU can abort there after a clean run
    args = parse_arguments(arguments)  # --help and flag errors end here, before torch is imported
    from cx_train._dry_run import dry_run_report
    from cx_train.config._options import validated_options

    options = validated_options(args)  # everything else checked before starting any process
    if not _verified(options):  # a --dry-run too: it says whether the run would start
        return 2
    if options.dry_run:
        print(dry_run_report(options), end="", flush=True)
        return 0
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.run import main as torchrun

    from cx_checkpoint import remove_stale_staging

    launcher = [
        *(["--standalone"] if options.rendezvous is None else options.rendezvous.torchrun_arguments()),
        "--nproc_per_node",
        str(options.nproc),
        "--signals_to_handle",  # SIGINT is handled here (_stop_once), not by the agent's own handler
        "SIGTERM,SIGHUP,SIGQUIT",
        "--max-restarts",  # a restart resumes from --save by itself (checkpoint._restart)
        str(options.max_restarts),
        "-m",
        "cx_train",
    ]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[_ARGS_VARIABLE] = json.dumps(arguments)
    previous = signal.signal(signal.SIGINT, _stop_once)
    try:
        torchrun(launcher)
    except SignalException as error:
        if error.sigval != signal.SIGINT:
            raise
        if options.save is not None:
            remove_stale_staging(options.save)  # a rank killed mid-save leaves its staging directory
        return INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0
