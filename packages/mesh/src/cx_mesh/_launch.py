"""Initialise torch.distributed for a cx job: from torchrun's environment or from explicit coordinates.

The backend follows the accelerator (NCCL on CUDA, gloo on CPU) unless given; every rank seeds torch and Python's
`random` identically so that model initialisation agrees across ranks; the collective timeout is configurable. An
uncaught exception on a rank ends that rank at once and is recorded for its peers, which then stop within moments
naming it (`_failures.install_failure_hook`) instead of waiting for the timeout. A rank that ends normally without
`dist.destroy_process_group()` has its groups destroyed at exit, while the interpreter is still whole: gloo's worker
threads otherwise outlive it and can abort the finished process ("terminate called without an active exception", one
run in two of a Hybrid tp 2 script that had printed its results).
Defaults match ColossalAI's: its `backend="nccl"` default runs the accelerator's backend (here `None`: NCCL on
CUDA, gloo without), and `verbose=True` logs "Distributed environment is initialized, world size: N" on rank 0.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore  # public as dist.*; the stub does not declare them

from cx_mesh._accelerator import get_accelerator
from cx_mesh._collective_log import clear_collective_log
from cx_mesh._failures import install_failure_hook
from cx_mesh._logging import get_dist_logger
from cx_mesh._timeouts import set_collective_timeout

__all__ = ["DEFAULT_TIMEOUT", "launch", "launch_from_torch", "set_seed"]

DEFAULT_TIMEOUT = timedelta(minutes=10)
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def set_seed(seed: int) -> None:
    """Seed Python's and torch's generators (all devices) with the same value."""
    random.seed(seed)
    torch.manual_seed(seed)


def launch(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str | None = None,
    local_rank: int | None = None,
    seed: int = 1024,
    verbose: bool = True,
    *,
    timeout: timedelta = DEFAULT_TIMEOUT,
    store_prefix: str = "",
) -> None:
    """Join the job as `rank` of `world_size`, rendezvousing at tcp://host:port (rank 0 hosts the store, or torchrun's
    agent does: `TORCHELASTIC_USE_AGENT_STORE`). A `store_prefix` keeps this job's keys apart from those of an earlier
    job on the same store (`launch_from_torch` names each torchrun restart).

    `backend=None` is the accelerator's (NCCL on CUDA, gloo without), which is what ColossalAI's default `"nccl"`
    runs. A backend this machine cannot run (NCCL without CUDA) falls back to the accelerator's with a warning, so
    scripts that hard-code `backend="nccl"` run on CPU. `verbose` (on by default, as in ColossalAI) logs
    ColossalAI's "Distributed environment is initialized" line on rank 0. `timeout` bounds how long any collective
    waits for a rank that is alive but stuck; an uncaught exception on a rank prints its traceback, records it in the
    job's store and ends that process at once (atexit handlers do not run), so its peers stop within moments with a
    `PeerFailedError` naming it.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size}) for world_size {world_size}")
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}")
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process; call launch only once "
            "(or dist.destroy_process_group() first)"
        )
    accelerator = get_accelerator()
    if local_rank is not None and accelerator.device_count() > 0:
        accelerator.set_device(local_rank % accelerator.device_count())
    chosen_backend = _runnable_backend(backend, accelerator.communication_backend)
    if store_prefix:
        agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        store = TCPStore(host, port, world_size, is_master=rank == 0 and not agent_hosts_it, timeout=timeout)
        dist.init_process_group(
            backend=chosen_backend,
            store=PrefixStore(store_prefix, store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    else:
        dist.init_process_group(
            backend=chosen_backend,
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    set_collective_timeout(timeout)  # every group cx creates later uses it too (torch's new_group would not)
    clear_collective_log()  # a new process group numbers its groups' collectives from 1 again
    install_failure_hook()  # a rank that raises stops its peers at once, its error first (not at the timeout)
    atexit.unregister(_destroy_groups_at_exit)  # one entry, however often a process launches
    atexit.register(_destroy_groups_at_exit)
    set_seed(seed)
    if verbose:
        get_dist_logger().info(
            f"Distributed environment is initialized, world size: {world_size} "
            f"(backend {chosen_backend} on {accelerator.name}, seed {seed})",
            ranks=[0],
        )


def _destroy_groups_at_exit() -> None:
    """Destroy the default group and every group made from it, unless the script did; never raises (the process is
    ending, and a peer that is gone must not turn a finished run into a failed one)."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _runnable_backend(requested: str | None, fallback: str) -> str:
    """`requested`, unless it is NCCL on a machine without CUDA: then the accelerator's backend, with a warning."""
    if requested is None:
        return fallback
    if requested.lower() == "nccl" and not torch.cuda.is_available():
        warnings.warn(f"backend 'nccl' needs CUDA, which this machine lacks: using {fallback!r} instead", stacklevel=3)
        return fallback
    return requested


def launch_from_torch(
    backend: str | None = None, seed: int = 1024, verbose: bool = True, *, timeout: timedelta = DEFAULT_TIMEOUT
) -> None:
    """Initialise from the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

    ColossalAI's positional order and defaults (see `launch`): `verbose=True` logs the initialized line on rank 0."""
    missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"launch_from_torch: environment variable(s) {', '.join(missing)} not set; "
            "start the script with torchrun (or set them), or call launch(rank, world_size, host, port)"
        )
    try:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        port = int(os.environ["MASTER_PORT"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError as error:
        raise RuntimeError(f"launch_from_torch: malformed torchrun environment variable: {error}") from None
    # torchrun's agent keeps its store across restarts of the ranks: each restart's keys go under their own prefix,
    # or a restarted rank reads a dead rank's address and fails to connect (Gloo connectFullMesh: refused)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    launch(
        rank,
        world_size,
        os.environ["MASTER_ADDR"],
        port,
        local_rank=local_rank,
        backend=backend,
        seed=seed,
        timeout=timeout,
        store_prefix=f"cx-restart-{restart}/",
        verbose=verbose,
    )
