"""A stuck or killed peer under TorchDDPPlugin and TorchFSDPPlugin is named: the gradient collectives run inside torch
(DDP's reducer, FSDP2's hooks), and used to end in a bare gloo "Timed out waiting 3000ms for recv" or "Connection reset
by peer" from `loss.backward()`. Through the Booster the surviving rank now gets a `CollectiveTimeoutError` or
`PeerFailedError` naming the phase, the group and the ranks."""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from cx_mesh import CollectiveTimeoutError, PeerFailedError, last_collectives, launch
from cx_mesh.testing import DistributedTestFailure, distributed, spawn
from cx_plugins import Booster, Plugin, TorchDDPPlugin, TorchFSDPPlugin
from cx_plugins.models import GPT
from plugins_test_helpers import CONFIG, LENGTH, LR

_TIMEOUT = timedelta(seconds=3)  # the process group's: how long rank 0 waits for the stuck rank
_BACKWARD = {
    "ddp": "gradient all-reduce in DDP backward",
    "fsdp": "parameter all-gather and gradient reduce-scatter in FSDP backward",
}
_FORWARD_DDP = "DDP forward (buffer broadcast, bucket rebuild)"
_GROUP = "on the default group (all ranks)"


def _plugin(name: str) -> Plugin:
    return TorchDDPPlugin() if name == "ddp" else TorchFSDPPlugin()


def _rank_1_fails_before_backward(rank: int, world_size: int, plugin: str, failure: str, flag: str, port: int) -> None:
    """One step on both ranks; at the second, rank 1 stops after its forward (stuck: it waits until rank 0 has
    checked its error; killed: it ends at once with no error recorded, as under SIGKILL)."""
    launch(rank, world_size, "127.0.0.1", port, verbose=False, timeout=_TIMEOUT)
    booster = Booster(plugin=_plugin(plugin))
    plain = GPT(CONFIG, seed=0)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR))
    assert optimizer is not None
    batch = torch.randint(0, CONFIG.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        loss = model(batch, labels=batch)
        if rank == 1 and optimizer.optim.state:  # the second step
            if failure == "killed":
                os._exit(1)
            while not Path(flag).exists():  # stuck past rank 0's timeout, not in any collective
                time.sleep(0.1)
            return
        if rank == 0 and optimizer.optim.state:
            break
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    expected = CollectiveTimeoutError if failure == "stuck" else PeerFailedError
    try:
        with pytest.raises(expected) as raised:
            booster.backward(loss, optimizer)
    finally:
        Path(flag).touch()
    message = str(raised.value)
    if failure == "stuck":
        assert message.startswith(f"{_BACKWARD[plugin]} {_GROUP} timed out after 0:00:03 on rank 0:"), message
        assert "rank(s) [1] did not say where they are within 3 s: not waiting in a cx collective" in message
        assert re.search(rf"#\d+ {_BACKWARD[plugin]} {re.escape(_GROUP)}\n", message), message  # its own log
        assert "Timed out waiting 3000ms" in message  # the backend's words come last
    else:
        assert message.startswith(
            f"{_BACKWARD[plugin]} {_GROUP} failed on rank 0: rank 1, the other rank of this group, ended (its "
            "connection closed) without recording an error"
        ), message


@pytest.mark.parametrize("plugin", ["ddp", "fsdp"])
def test_a_stuck_peer_gives_a_named_timeout(plugin: str, tmp_path: Path) -> None:
    spawn(_rank_1_fails_before_backward, 2, plugin, "stuck", str(tmp_path / "checked"), timeout=120)


@pytest.mark.parametrize("plugin", ["ddp", "fsdp"])
def test_a_killed_peer_gives_a_named_peer_failure(plugin: str, tmp_path: Path) -> None:
    with pytest.raises(DistributedTestFailure) as failure:
        spawn(_rank_1_fails_before_backward, 2, plugin, "killed", str(tmp_path / "checked"), timeout=120)
    report = str(failure.value)
    assert "rank 1 exited with code 1 before reporting a result" in report
    assert "rank 0 raised" not in report, report  # rank 0 got the named error it expected


@distributed(world_size=2)
def test_fp16_loss_scaling_keeps_the_ddp_phase_names(rank: int, world_size: int) -> None:
    """The Booster swaps DDP's optimizer wrapper for a loss-scaling one in fp16: the backward stays named."""
    booster = Booster(mixed_precision="fp16", plugin=TorchDDPPlugin())
    plain = GPT(CONFIG, seed=0)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR))
    assert optimizer is not None
    batch = torch.randint(0, CONFIG.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(rank))
    booster.backward(model(batch, labels=batch), optimizer)
    optimizer.step()
    kinds = [record.kind for record in last_collectives()[-2:]]
    assert kinds == [_FORWARD_DDP, _BACKWARD["ddp"]]
