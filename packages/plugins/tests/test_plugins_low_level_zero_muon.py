"""`booster.boost(model, torch.optim.Muon(matrices))` under LowLevelZeroPlugin stage 1 and 2 gives one process's
result (each matrix stepped whole on one owner rank, cx_zero's `_whole_step`), and its checkpoint (the momentum
whole by name) resumes bit-exactly. The bound (0.2 of one effective step lr * sqrt(max(1, rows / cols)) per
parameter after 3 steps) is derived in packages/zero/tests/test_zero_low_level_muon.py: bf16 Newton-Schulz turns a
rare flipped rounding of its input into a visible but bounded difference; slice-wise orthogonalisation is off by
far more."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import Booster, LowLevelZeroPlugin, ModelWrapper

LR, STEPS, PER_RANK, FLIP_BOUND = 0.02, 3, 3, 0.2


def _model() -> nn.Module:
    """Matrices that straddle the two ranks' flat shards (the 5 x 3 one also ends in padding)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 12, bias=False), nn.Tanh(), nn.Linear(12, 5, bias=False), nn.Tanh(), nn.Linear(5, 3, bias=False)
    )


def _muon(model: nn.Module) -> torch.optim.Optimizer:
    first, *rest = list(model.parameters())
    groups: list[dict[str, Any]] = [{"params": [first], "lr": 2 * LR}, {"params": rest}]
    return torch.optim.Muon(groups, lr=LR, weight_decay=0.01)


def _batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(PER_RANK * world_size, 8, generator=generator)
    return x, torch.randn(PER_RANK * world_size, 3, generator=generator)


@distributed(world_size=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_plugins_low_level_zero_muon_matches_one_process(
    rank: int, world_size: int, stage: int, tmp_path: Path
) -> None:
    booster = Booster(plugin=LowLevelZeroPlugin(stage=stage, precision="fp32"))
    plain = _model()
    model, optimizer, *_ = booster.boost(plain, _muon(plain))
    assert isinstance(model, ModelWrapper)
    assert optimizer is not None
    reference = _model()
    reference_optimizer = _muon(reference)
    for step in range(STEPS):
        x, y = _batch(step, world_size)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        booster.backward(nn.functional.mse_loss(model(x[mine]), y[mine]), optimizer)
        optimizer.step()
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    lrs = {id(p): g["lr"] for g in reference_optimizer.param_groups for p in g["params"]}
    for (name, mine_p), want in zip(model.unwrap().named_parameters(), reference.parameters(), strict=True):
        rows, cols = want.shape
        bound = FLIP_BOUND * lrs[id(want)] * math.sqrt(max(1.0, rows / cols))
        torch.testing.assert_close(mine_p.detach(), want.detach(), rtol=0, atol=bound, msg=name)
    # the checkpoint IO's own files (no pickle): a fresh boosted pair resumes bit-exactly
    booster.save_model(model, tmp_path / "model", shard=True)
    booster.save_optimizer(optimizer, tmp_path / "optimizer", shard=True)
    torch.distributed.barrier()
    fresh = _model()
    resumed, resumed_optimizer, *_ = booster.boost(fresh, _muon(fresh))
    assert isinstance(resumed, ModelWrapper)
    assert resumed_optimizer is not None
    booster.load_model(resumed, tmp_path / "model")
    booster.load_optimizer(resumed_optimizer, tmp_path / "optimizer")
    x, y = _batch(STEPS, world_size)
    for boosted_model, boosted_optimizer in ((model, optimizer), (resumed, resumed_optimizer)):
        booster.backward(nn.functional.mse_loss(boosted_model(x[mine]), y[mine]), boosted_optimizer)
        boosted_optimizer.step()
        boosted_optimizer.zero_grad()
    for (name, p), q in zip(model.unwrap().named_parameters(), resumed.unwrap().parameters(), strict=True):
        assert torch.equal(p, q), name
