"""Killing a training process in the middle of `booster.save_model` never damages the previous checkpoint: the path
always loads, strictly, as one complete version (never a mix of two, never a half-written one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from cx_checkpoint import GeneralCheckpointIO
from cx_mesh.testing import free_port

_SAVER = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from cx_mesh import launch
    from cx_plugins import Booster, GeminiPlugin, TorchDDPPlugin

    directory, plugin_name, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    launch(0, 1, "127.0.0.1", port)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])
    template = {name: value.clone() for name, value in model.state_dict().items()}
    if plugin_name == "gemini":
        plugin = GeminiPlugin(precision="fp32", chunk_config_dict={"chunk_size": 256 * 257})
    else:
        plugin = TorchDDPPlugin()
    booster = Booster(plugin=plugin)
    boosted, *_ = booster.boost(model)
    version = 0
    while True:
        # every tensor holds the version number, so a checkpoint mixing two versions is visible
        state = {name: torch.full_like(value, float(version)) for name, value in template.items()}
        (boosted.ddp if plugin_name == "gemini" else model).load_state_dict(state)
        booster.save_model(boosted, directory + "/ckpt", shard=True, use_safetensors=True, size_per_shard=1)
        print(version, flush=True)
        version += 1
    """
)


def _template() -> nn.Module:
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])


@pytest.mark.parametrize("plugin", ["torch_ddp", "gemini"])
def test_plugins_kill_during_booster_save(tmp_path: Path, plugin: str) -> None:
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    io = GeneralCheckpointIO()
    for delay in (0.05, 0.13, 0.31):
        process = subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), plugin, str(free_port())],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        first = process.stdout.readline()  # one complete checkpoint exists from here on
        assert first.strip().isdigit(), process.stderr.read() if process.stderr else first
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        model = _template()
        io.load_model(model, tmp_path / "ckpt", strict=True)
        values = {float(p.detach().flatten()[0]) for p in model.parameters()}
        assert len(values) == 1, f"a mix of checkpoint versions was loaded: {sorted(values)}"
        assert all(torch.all(p == next(iter(values))) for p in model.parameters())
