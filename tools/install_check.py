"""The install check `nox -s install_check` runs under `torchrun --nproc_per_node 2`, in a venv holding only what
`pip install --find-links dist 'cx-train[hf]'` put there.

Every rank imports each of the ten cx packages, checks that it came from the venv's site-packages (a checkout on
sys.path would hide a broken wheel), and takes part in one all-reduce over gloo through cx_mesh: an install that
resolves but cannot start a job fails here, not on the user's machine. Rank 0 also reads the installed metadata:
cx-plugins requires none of the trainer's extras (pyarrow, datasets, tensorboard, matplotlib), which belong to
cx-train.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist

PACKAGES = (
    "cx_mesh",
    "cx_checkpoint",
    "cx_chunk",
    "cx_zero",
    "cx_moe",
    "cx_pipeline",
    "cx_shardformer",
    "cx_plugins",
    "cx_plan",
    "cx_train",
)
TRAINER_ONLY = ("pyarrow", "datasets", "tensorboard", "matplotlib")  # cx-train's extras, never cx-plugins'


def _check_imports() -> None:
    """Import every package and fail naming the one that is missing or not loaded from the installed wheel."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for name in PACKAGES:
        module = importlib.import_module(name)
        origin = Path(module.__file__ or "").resolve()
        if site not in origin.parents:
            raise SystemExit(f"install check: {name} was imported from {origin}, not from the venv's {site}")


def _check_plugins_metadata() -> None:
    """cx-plugins alone installs without the trainer's extras: none of them in any of its requirements."""
    requirements = importlib.metadata.requires("cx-plugins") or []
    leaked = [r for r in requirements if any(r.startswith(name) for name in TRAINER_ONLY)]
    if leaked:
        raise SystemExit(f"install check: cx-plugins requires the trainer's extras {leaked}; they belong to cx-train")


def main() -> None:
    _check_imports()
    _check_plugins_metadata()
    import cx_mesh  # imported by _check_imports; bound here for the typed calls below

    cx_mesh.launch_from_torch(backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    cx_mesh.all_reduce(value)
    expected = world * (world + 1) / 2  # 1 + 2 + ... + world, exact in float32 for any small world
    if value.item() != expected:
        raise SystemExit(f"install check: rank {rank} all-reduce gave {value.item()}, expected {expected}")
    if rank == 0:
        print(f"install check: {len(PACKAGES)} packages imported from site-packages, all-reduce over {world} ranks ok")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch 2.13 on CPU may abort at interpreter exit after gloo work (shared/peers.md)


if __name__ == "__main__":
    main()
