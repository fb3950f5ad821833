"""Loading a checkpoint while another process keeps committing new saves to the same path sees exactly one save:
every tensor of a load comes from the same version (never a mix of two or three), and no load fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from cx_checkpoint import GeneralCheckpointIO

_WRITER = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from cx_checkpoint import GeneralCheckpointIO

    target, what, commits = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(24)])
    optimizer = torch.optim.SGD(model.named_parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 32)).sum().backward()
    optimizer.step()
    io = GeneralCheckpointIO()
    for version in range(commits):
        # every tensor holds the version number, so a load mixing two saves is visible
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(float(version))
                optimizer.state[parameter]["momentum_buffer"].fill_(float(version))
        if what == "model":
            io.save_model(model, target, shard=True, use_safetensors=True, size_per_shard=4096 / 2**20)
        elif what == "model_single":
            io.save_model(model, target, use_safetensors=True)
        else:
            io.save_optimizer(optimizer, target, shard=True, size_per_shard=4096 / 2**20)
        if version == 0:
            print("first", flush=True)
    """
)


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(24)])


def _loaded_versions(io: GeneralCheckpointIO, target: Path, what: str) -> set[float]:
    model = _model()
    if what != "optimizer":
        io.load_model(model, target)
        return {float(v) for p in model.parameters() for v in p.detach().unique()}
    optimizer = torch.optim.SGD(model.named_parameters(), lr=0.1, momentum=0.9)
    io.load_optimizer(optimizer, target)
    return {float(v) for state in optimizer.state.values() for v in state["momentum_buffer"].unique()}


@pytest.mark.parametrize("what", ["model", "optimizer", "model_single"])
def test_checkpoint_load_during_concurrent_saves_sees_one_save(tmp_path: Path, what: str) -> None:
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    target = tmp_path / ("model.safetensors" if what == "model_single" else "ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    commits = {"model": 15, "optimizer": 10, "model_single": 8}[what]
    writer = subprocess.Popen(
        [sys.executable, str(script), str(target), what, str(commits)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    first = writer.stdout.readline()
    assert first.strip() == "first", writer.stderr.read() if writer.stderr else first
    io = GeneralCheckpointIO()
    loads, mixed, failed = 0, [], []
    try:
        while writer.poll() is None and loads < 400:  # stops by itself: the writer makes a bounded number of saves
            try:
                versions = _loaded_versions(io, target, what)
            except Exception as error:
                failed.append(f"{type(error).__name__}: {error}")
            else:
                if len(versions) != 1:
                    mixed.append(sorted(versions))
            loads += 1
    finally:
        writer.kill()
        writer.wait(timeout=30)
    assert loads >= 5, f"only {loads} loads overlapped the saves"
    assert not mixed, f"{len(mixed)} of {loads} loads mixed several saves, e.g. versions {mixed[0]}"
    assert not failed, f"{len(failed)} of {loads} loads failed, e.g. {failed[0]}"
    final = _loaded_versions(io, target, what)
    assert len(final) == 1
    assert torch.is_tensor(torch.tensor(sorted(final)))
