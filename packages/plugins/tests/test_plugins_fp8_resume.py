"""Straight against saved-and-resumed training, bit for bit, for every ZeRO plugin x precision x
fp8_communication. With fp8 communication the working weights are the E4M3 all-gather of the fp32 masters (a
rounding of them even at fp32 precision), so the optimizer checkpoint must carry the masters: without them a resume
would restart from the rounded weights and drift (issue 35)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import TEST_ADAM_EPS, distributed
from cx_plugins import Booster, HybridParallelPlugin, OptimizerWrapper, Plugin
from cx_plugins.models import GPT
from plugins_test_helpers import CONFIG, LR, data, full_state, make_plugin, train

SAVE_AT, STEPS = 3, 5


def _plugin(name: str, **options: Any) -> Plugin:
    if name == "hybrid_zero1":
        return HybridParallelPlugin(tp_size=1, pp_size=1, zero_stage=1, **options)
    return make_plugin(name, **options)


def _boost(name: str, seed: int, **options: Any) -> tuple[Booster, nn.Module, OptimizerWrapper]:
    booster = Booster(plugin=_plugin(name, **options))
    plain = GPT(CONFIG, seed=seed)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    return booster, model, optimizer


@distributed(world_size=2)
@pytest.mark.parametrize("fp8_communication", [False, True], ids=["plain", "fp8comm"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("plugin", ["zero1", "zero2", "hybrid_zero1"])
def test_plugins_zero_resume_is_exact(
    rank: int, world_size: int, plugin: str, precision: str, fp8_communication: bool, tmp_path: Path
) -> None:
    options = {"precision": precision, "fp8_communication": fp8_communication}
    batches = data(STEPS)
    booster, model, optimizer = _boost(plugin, seed=0, **options)
    train(rank, world_size, booster, model, optimizer, batches[:SAVE_AT])
    booster.save_model(model, tmp_path / "model", shard=True, use_safetensors=True)
    booster.save_optimizer(optimizer, tmp_path / "optimizer", shard=True)
    assert not any(path.suffix in {".bin", ".pt", ".pkl"} for path in tmp_path.rglob("*")), "no pickle"

    resumed_booster, resumed_model, resumed = _boost(plugin, seed=1, **options)  # another start point
    resumed_booster.load_model(resumed_model, tmp_path / "model")
    resumed_booster.load_optimizer(resumed, tmp_path / "optimizer")

    straight = train(rank, world_size, booster, model, optimizer, batches[SAVE_AT:])
    again = train(rank, world_size, resumed_booster, resumed_model, resumed, batches[SAVE_AT:])
    assert again == straight, f"losses after the resume {again} differ from the straight run's {straight}"
    want = full_state(model)
    for name, value in full_state(resumed_model).items():
        assert torch.equal(value, want[name]), f"{plugin} {precision} fp8_communication={fp8_communication}: {name}"
