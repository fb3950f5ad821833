"""fp8_communication on one rank, every plugin: nothing to compress (no collective or p2p runs), so building the
plugin gives exactly one UserWarning naming the switch, never an error and never silence, and a one-rank debug run of
the multi-rank config boosts and trains a step (the cx_mesh.fp8 collectives copy exactly for a group of one)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import (
    Booster,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    MoeHybridParallelPlugin,
    Plugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)

PLUGINS: dict[str, Callable[..., Plugin]] = {
    "TorchDDPPlugin": TorchDDPPlugin,
    "TorchFSDPPlugin": TorchFSDPPlugin,
    "LowLevelZeroPlugin": lambda **fp8: LowLevelZeroPlugin(precision="bf16", **fp8),
    "GeminiPlugin": lambda **fp8: GeminiPlugin(precision="bf16", **fp8),
    "HybridParallelPlugin": lambda **fp8: HybridParallelPlugin(tp_size=1, pp_size=1, precision="bf16", **fp8),
    "MoeHybridParallelPlugin": lambda **fp8: MoeHybridParallelPlugin(
        ep_size=1, tp_size=1, pp_size=1, precision="bf16", **fp8
    ),
}
MESSAGE = "(fp8_communication=True): nothing to compress on a single rank"


def _about_fp8_communication(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "fp8_communication" in str(w.message)]


@distributed(world_size=1)
def test_plugins_fp8_communication_on_one_rank_warns_once_and_trains(rank: int, world_size: int) -> None:
    for name, build in PLUGINS.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plugin = build(fp8_communication=True)
        messages = _about_fp8_communication(caught)
        assert messages == [f"{name}{MESSAGE} (no collective or p2p runs); training proceeds without fp8 "
                            "communication"], (name, messages)  # fmt: skip
        assert all(w.category is UserWarning for w in caught if "fp8_communication" in str(w.message))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        booster = Booster(plugin=plugin)
        boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert optimizer is not None
        losses = []
        for _ in range(2):  # one step between two forwards: the run trains (a NaN or inf loss fails the < too)
            loss = boosted(torch.ones(2, 16)).float().square().mean()
            losses.append(loss.item())
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
        assert losses[1] < losses[0], (name, losses)
        # without the switch: no such warning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build()
        assert not _about_fp8_communication(caught), name
    # with use_fp8 too (the plain Linears still compute in fp8): the same single warning, no error
    with pytest.warns(UserWarning, match=r"HybridParallelPlugin\(fp8_communication=True\): nothing to compress"):
        HybridParallelPlugin(tp_size=1, pp_size=1, fp8_communication=True, use_fp8=True)
