"""Ranks that boost with different settings (precision, optimizer kind, hyper-parameters) fail at `boost` on every
rank, with an error that names the differing field, instead of training and drifting apart silently."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cx_mesh import RankMismatchError
from cx_mesh.testing import distributed
from cx_plugins import Booster, LowLevelZeroPlugin, TorchDDPPlugin


def _boost_expecting(
    booster: Booster, optimizer: torch.optim.Optimizer, model: nn.Module, expected: str, only: bool = True
) -> None:
    with pytest.raises(RankMismatchError) as caught:
        booster.boost(model, optimizer)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("ranks disagree on Booster settings: ranks [1] differ from ranks [0]")
    assert lines[1:] == [expected] if only else expected in lines[1:]


@distributed(world_size=2)
def test_booster_mixed_precision_differing_by_rank_is_named(rank: int, world_size: int) -> None:
    model = nn.Linear(4, 4)
    booster = Booster(mixed_precision="bf16" if rank == 0 else "fp16", plugin=TorchDDPPlugin())
    expected = "  mixed_precision: ranks [0]: 'bf16'; ranks [1]: 'fp16'"
    _boost_expecting(booster, torch.optim.SGD(model.parameters(), lr=0.1), model, expected)


@distributed(world_size=2)
def test_booster_optimizer_hyperparameters_differing_by_rank_are_named(rank: int, world_size: int) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    groups: list[dict[str, object]] = [
        {"params": model[0].parameters()},
        {"params": model[1].parameters(), "weight_decay": 0.1 if rank == 0 else 0.2},
    ]
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=1e-3)
    expected = "  param_groups[1]['weight_decay']: ranks [0]: 0.1; ranks [1]: 0.2"
    _boost_expecting(Booster(plugin=TorchDDPPlugin()), optimizer, model, expected)
    # betas (a tuple) and the optimizer's kind are compared too
    linear = nn.Linear(4, 4)
    betas = (0.9, 0.999 if rank == 0 else 0.95)
    expected = "  param_groups[0]['betas'][1]: ranks [0]: 0.999; ranks [1]: 0.95"
    optimizer = torch.optim.Adam(linear.parameters(), betas=betas)
    _boost_expecting(Booster(plugin=TorchDDPPlugin()), optimizer, linear, expected)
    linear = nn.Linear(4, 4)
    kind = torch.optim.Adam if rank == 0 else torch.optim.AdamW
    optimizer = kind(linear.parameters(), lr=1e-3, weight_decay=0.01)
    expected = "  optimizer: ranks [0]: 'Adam'; ranks [1]: 'AdamW'"  # (AdamW's defaults differ too: not only)
    _boost_expecting(Booster(plugin=TorchDDPPlugin()), optimizer, linear, expected, only=False)


@distributed(world_size=2)
def test_booster_learning_rate_differing_under_zero_is_named(rank: int, world_size: int) -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 if rank == 0 else 0.01)
    expected = "  param_groups[0]['lr']: ranks [0]: 0.1; ranks [1]: 0.01"
    _boost_expecting(Booster(plugin=LowLevelZeroPlugin(stage=1)), optimizer, model, expected)
