"""`booster.boost(model, torch.optim.Muon(matrices))` under LowLevelZeroPlugin stage 1 and 2 gives one process's
result (each matrix stepped whole on one owner rank, cx_zero's `_whole_step`), and its checkpoint (the momentum
whole by name) resumes bit-exactly. The bound (0.2 of one effective step lr * sqrt(max(1, rows / cols)) per
parameter after 3 steps) is derived in packages/zero/tests/test_zero_low_level_muon.py: bf16 Newton-Schulz turns a
rare flipped rounding of its input into a visible but bounded difference; slice-wise orthogonalisation is off by
far more."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import Booster, LowLevelZeroPlugin, ModelWrapper
from muon_test_helpers import (
    STEPS,
    boosted_step,
    muon_bound,
    rank_rows,
    reference_step,
    regression_batch,
    save_and_load_fresh,
    tiny_matrices,
    two_lr_muon,
)


@distributed(world_size=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_plugins_low_level_zero_muon_matches_one_process(
    rank: int, world_size: int, stage: int, tmp_path: Path
) -> None:
    booster = Booster(plugin=LowLevelZeroPlugin(stage=stage, precision="fp32"))
    plain = tiny_matrices()  # matrices that straddle the two ranks' flat shards (the 5 x 3 one also ends in padding)
    model, optimizer, *_ = booster.boost(plain, two_lr_muon(plain))
    assert isinstance(model, ModelWrapper)
    assert optimizer is not None
    reference = tiny_matrices()
    reference_optimizer = two_lr_muon(reference)
    mine = rank_rows(rank)
    for step in range(STEPS):
        x, y = regression_batch(step, world_size)
        boosted_step(booster, nn.functional.mse_loss(model(x[mine]), y[mine]), optimizer)
        reference_step(nn.functional.mse_loss(reference(x), y), reference_optimizer)
    lrs = {id(p): g["lr"] for g in reference_optimizer.param_groups for p in g["params"]}
    for (name, mine_p), want in zip(model.unwrap().named_parameters(), reference.parameters(), strict=True):
        bound = muon_bound(lrs[id(want)], *want.shape)
        torch.testing.assert_close(mine_p.detach(), want.detach(), rtol=0, atol=bound, msg=name)
    # the checkpoint IO's own files (no pickle): a fresh boosted pair resumes bit-exactly
    resumed, resumed_optimizer = save_and_load_fresh(booster, model, optimizer, tiny_matrices, two_lr_muon, tmp_path)
    assert isinstance(resumed, ModelWrapper)
    x, y = regression_batch(STEPS, world_size)
    for boosted_model, boosted_optimizer in ((model, optimizer), (resumed, resumed_optimizer)):
        boosted_step(booster, nn.functional.mse_loss(boosted_model(x[mine]), y[mine]), boosted_optimizer)
    for (name, p), q in zip(model.unwrap().named_parameters(), resumed.unwrap().parameters(), strict=True):
        assert torch.equal(p, q), name
