"""fp16 resume through the Booster after the loss scale has moved: an overflow backs it off and a good step grows the
growth counter before the save, so a checkpoint that lost the scaler's state (scale, growth and hysteresis counters)
resumes at the constructor's `initial_scale` and is caught. The resumed run must then continue exactly like the
uninterrupted one (same world size, so bit for bit), including the next growth of the scale."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import Booster, OptimizerWrapper
from cx_plugins.gemini._plugin import GeminiOptimizerWrapper
from cx_plugins.models import GPT
from cx_plugins.wrappers._zero import ZeroOptimizerWrapper
from plugins_test_helpers import CONFIG, GLOBAL_BATCH, LR, data, full_state, make_plugin

INITIAL_SCALE = 2.0**8
OPTIONS = {"precision": "fp16", "initial_scale": INITIAL_SCALE, "hysteresis": 1, "growth_interval": 2}


def _boost(plugin: str, seed: int) -> tuple[Booster, nn.Module, OptimizerWrapper]:
    booster = Booster(plugin=make_plugin(plugin, **OPTIONS))
    plain = GPT(CONFIG, seed=seed)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR))
    assert optimizer is not None
    return booster, model, optimizer


def _scale(optimizer: OptimizerWrapper) -> float:
    assert isinstance(optimizer, (ZeroOptimizerWrapper, GeminiOptimizerWrapper))
    return optimizer.loss_scale


def _step(
    rank: int, world_size: int, booster: Booster, model: nn.Module, optimizer: OptimizerWrapper, batch: torch.Tensor,
    overflow: bool = False,
) -> None:  # fmt: skip
    per_rank = GLOBAL_BATCH // world_size
    mine = batch[rank * per_rank : (rank + 1) * per_rank]
    loss = model(mine, labels=mine)
    booster.backward(loss * float("inf") if overflow and rank == 0 else loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()


@distributed(world_size=2)
@pytest.mark.parametrize("plugin", ["zero2", "gemini"])
def test_plugins_fp16_resume_restores_a_moved_loss_scale(
    rank: int, world_size: int, plugin: str, tmp_path: Path
) -> None:
    batches = data(6)
    booster, model, optimizer = _boost(plugin, seed=0)
    _step(rank, world_size, booster, model, optimizer, batches[0])
    _step(rank, world_size, booster, model, optimizer, batches[1], overflow=True)  # backs the scale off
    _step(rank, world_size, booster, model, optimizer, batches[2])  # one good step towards the next growth
    assert _scale(optimizer) == INITIAL_SCALE / 2, "the scale must have moved before the save"
    booster.save_model(model, tmp_path / "model", shard=True)
    booster.save_optimizer(optimizer, tmp_path / "optimizer", shard=True)

    resumed_booster, resumed_model, resumed = _boost(plugin, seed=1)
    assert _scale(resumed) == INITIAL_SCALE
    resumed_booster.load_model(resumed_model, tmp_path / "model")
    resumed_booster.load_optimizer(resumed, tmp_path / "optimizer")
    assert _scale(resumed) == _scale(optimizer)

    for batch in batches[3:]:
        _step(rank, world_size, booster, model, optimizer, batch)
        _step(rank, world_size, resumed_booster, resumed_model, resumed, batch)
        assert _scale(resumed) == _scale(optimizer), "the growth counter was restored too"
    assert _scale(optimizer) > INITIAL_SCALE / 2, "the scale grew again after the resume"
    want = full_state(model)
    for name, value in full_state(resumed_model).items():
        assert torch.equal(value, want[name]), f"{plugin}: {name} differs after resuming"
