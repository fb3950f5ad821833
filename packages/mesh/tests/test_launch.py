"""launch / launch_from_torch: a real torchrun job, and clear errors for bad input."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cx_mesh import ProcessGroupMesh, collective_timeout, launch, launch_from_torch
from cx_mesh.testing import free_port, spawn

_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from cx_mesh import launch_from_torch, get_accelerator
    launch_from_torch()
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    seeded = torch.rand(1).item()
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w") as out:
        out.write(f"{dist.get_world_size()} {t.item()} {dist.get_backend()} {seeded} {os.environ['LOCAL_RANK']}")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
    """
)


def test_launch_from_torch_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [(tmp_path / f"rank{r}").read_text().split() for r in range(2)]
    for local_rank, (world, total, backend, _seeded, local) in enumerate(reports):
        assert (int(world), float(total), backend, int(local)) == (2, 1.0, "gloo", local_rank)
    assert reports[0][3] == reports[1][3], "ranks must be seeded alike"
    # ColossalAI's defaults: backend "nccl" runs the accelerator's (gloo here, silently: no fallback warning) and
    # verbose=True logs the initialized line, on rank 0 only
    assert result.stderr.count("Distributed environment is initialized, world size: 2") == 1, result.stderr[-3000:]
    assert "needs CUDA" not in result.stderr


def test_launch_defaults_follow_colossalai() -> None:
    for function in (launch, launch_from_torch):
        parameters = inspect.signature(function).parameters
        assert parameters["verbose"].default is True, function.__name__
        assert parameters["seed"].default == 1024, function.__name__
        assert parameters["backend"].default is None, function.__name__  # the accelerator's: NCCL on CUDA, else gloo
    assert list(inspect.signature(launch_from_torch).parameters)[:3] == ["backend", "seed", "verbose"]


def test_launch_from_torch_without_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        launch_from_torch()


def test_launch_rejects_bad_coordinates() -> None:
    with pytest.raises(ValueError, match="rank 2 is outside"):
        launch(2, 2, "127.0.0.1", 29500)
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        launch(0, 0, "127.0.0.1", 29500)
    with pytest.raises(ValueError, match="port"):
        launch(0, 1, "127.0.0.1", 70000)


def _launch_explicitly(rank: int, world_size: int, port: int) -> None:
    launch(rank, world_size, "127.0.0.1", port, timeout=timedelta(seconds=60), seed=7)
    assert dist.get_backend() == "gloo"
    expected = torch.Generator().manual_seed(7)
    assert torch.equal(torch.rand(3), torch.rand(3, generator=expected))
    with pytest.raises(RuntimeError, match="already initialised"):
        launch(rank, world_size, "127.0.0.1", port)
    # the launch timeout reaches every group cx creates later (torch's new_group alone would use its 30 min default)
    assert collective_timeout() == timedelta(seconds=60)
    assert ProcessGroupMesh(world_size).timeout == timedelta(seconds=60)
    dist.barrier()


def test_launch_explicit_rendezvous() -> None:
    spawn(_launch_explicitly, 2, free_port(), init_process_group=False, timeout=60)


def _launch_with_nccl_on_cpu(rank: int, world_size: int, port: int) -> None:
    # ColossalAI scripts pass backend="nccl": without CUDA it falls back to gloo with a warning instead of failing
    with pytest.warns(UserWarning, match="backend 'nccl' needs CUDA"):  # ColossalAI's positional order
        launch(rank, world_size, "127.0.0.1", port, "nccl", None, 1024, True, timeout=timedelta(seconds=60))
    assert dist.get_backend() == "gloo"
    dist.barrier()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
def test_launch_nccl_without_cuda_falls_back_to_gloo() -> None:
    spawn(_launch_with_nccl_on_cpu, 2, free_port(), init_process_group=False, timeout=60)


_ENDS_WITHOUT_DESTROY = textwrap.dedent(
    """
    import atexit, sys, torch, torch.distributed as dist
    from cx_mesh import launch
    from cx_mesh.testing import free_port
    # registered before launch, so it runs after launch's own exit handler (atexit runs last-in first-out)
    atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
    launch(0, 1, "127.0.0.1", free_port(), backend="gloo", verbose=False)
    group = dist.new_group([0])
    pending = dist.all_reduce(torch.ones(4), group=group, async_op=True)  # never waited for
    print("done", flush=True)
    """
)


def test_launch_destroys_the_groups_of_a_script_that_ends_without_destroying_them(tmp_path: Path) -> None:
    """A script that ends normally with live groups (and work never waited for) has them destroyed while the
    interpreter is whole: left to interpreter teardown, gloo's threads could abort the finished process."""
    script = tmp_path / "job.py"
    script.write_text(_ENDS_WITHOUT_DESTROY)
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=environment)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["done", "initialized at exit: False"], done.stdout
