"""The bf16 non-finite-loss check after its first calls (issue 37): the loss is recorded on the device each backward
and read on the first 3 calls, every `finite_loss_check_every` calls and before a save, so a NaN loss later in the
run is named at the next check, by the step it happened at, and never reaches a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cx_mesh.testing import distributed
from cx_plugins import Booster, OptimizerWrapper
from cx_plugins._finite_loss import FIRST_CHECKED_CALLS
from cx_plugins.models import GPT
from plugins_test_helpers import CONFIG, GLOBAL_BATCH, data, make_plugin

BAD_STEP, EVERY = 5, 4


def _booster(plugin: str) -> tuple[Booster, torch.nn.Module, OptimizerWrapper]:
    if plugin == "torch_ddp":
        booster = Booster(plugin=make_plugin(plugin), mixed_precision="bf16")
    else:
        booster = Booster(plugin=make_plugin(plugin, precision="bf16"))
    booster.finite_loss_check_every = EVERY
    plain = GPT(CONFIG, seed=0)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    assert optimizer is not None
    return booster, model, optimizer


@distributed(world_size=2)
@pytest.mark.parametrize("plugin", ["torch_ddp", "zero2"])
def test_plugins_bf16_later_nan_loss_is_named_at_the_next_check(rank: int, world_size: int, plugin: str) -> None:
    assert BAD_STEP > FIRST_CHECKED_CALLS, "the bad step is past the calls checked at once"
    assert BAD_STEP % EVERY != 0, "and is not itself a checked call"
    booster, model, optimizer = _booster(plugin)
    per_rank = GLOBAL_BATCH // world_size
    raised_at, message = None, ""
    for step, batch in enumerate(data(2 * EVERY), start=1):
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        loss = model(mine, labels=mine)
        if step == BAD_STEP and rank == 1:
            loss = loss * float("nan")
        try:
            booster.backward(loss, optimizer)
        except FloatingPointError as error:
            message = str(error)
            raised_at = step
            break
        optimizer.step()
        optimizer.zero_grad()
    assert raised_at == 2 * EVERY, "the first check after the bad step (call 8) raises, not before"
    assert f"not finite on rank(s) [1] at optimizer step {BAD_STEP} (backward call {BAD_STEP})" in message
    assert f"found at backward call {2 * EVERY}" in message
    assert "may hold NaN" in message


@distributed(world_size=2)
def test_plugins_bf16_nan_loss_is_checked_before_a_save(rank: int, world_size: int, tmp_path: Path) -> None:
    booster, model, optimizer = _booster("zero2")
    per_rank = GLOBAL_BATCH // world_size
    for step, batch in enumerate(data(BAD_STEP), start=1):
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        loss = model(mine, labels=mine)
        booster.backward(loss * float("nan") if step == BAD_STEP and rank == 0 else loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    target = tmp_path / f"model-{rank}"
    with pytest.raises(FloatingPointError, match=rf"rank\(s\) \[0\] at optimizer step {BAD_STEP}.*before saving"):
        booster.save_model(model, target)
    assert not target.exists(), "nothing was written"
