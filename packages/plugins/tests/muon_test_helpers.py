"""Shared pieces of the plugin Muon tests: their learning rates and steps, the flipped-rounding bound (0.2 of one
effective step lr * sqrt(max(1, rows / cols)) per Muon matrix, 0.2 of lr per step taken per AdamW parameter; derived
in packages/zero/tests/test_zero_low_level_muon.py and test_plugins_zero_muon_adamw.py), the tiny matrix model with
its batches, the optimizers on both sides, one training step each side, and the save / load into a fresh boosted pair
that each test then steps beside the original to check a bit-exact resume."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cx_plugins import Booster, GeminiPlugin, HybridParallelPlugin, OptimizerWrapper
from cx_zero import MuonWithAdamW, muon_param_groups
from hybrid_test_helpers import batch, llama

MUON_LR, ADAMW_LR, STEPS, PER_RANK, FLIP_BOUND = 0.02, 0.003, 3, 3, 0.2
ADAMW_BOUND = FLIP_BOUND * ADAMW_LR * STEPS


def muon_bound(lr: float, rows: int, cols: int) -> float:
    """0.2 of one effective Muon step of a rows x cols matrix at `lr`."""
    return FLIP_BOUND * lr * math.sqrt(max(1.0, rows / cols))


def tiny_matrices() -> nn.Module:
    """Three bias-free linears (8 -> 12 -> 5 -> 3): matrices only, so torch's Muon takes every parameter."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 12, bias=False), nn.Tanh(), nn.Linear(12, 5, bias=False), nn.Tanh(), nn.Linear(5, 3, bias=False)
    )


def two_lr_muon(model: nn.Module) -> torch.optim.Optimizer:
    """torch's Muon over the 2-D parameters, the first at twice the lr of the rest (two param groups)."""
    first, *rest = [p for p in model.parameters() if p.ndim == 2]
    groups: list[dict[str, Any]] = [{"params": [first], "lr": 2 * MUON_LR}, {"params": rest}]
    return torch.optim.Muon(groups, lr=MUON_LR, weight_decay=0.01)


def torch_muon(model: nn.Module) -> torch.optim.Optimizer:
    """torch's Muon over the trainable parameters (see `freeze_all_but_matrices`)."""
    return torch.optim.Muon([p for p in model.parameters() if p.requires_grad], lr=MUON_LR, weight_decay=0.01)


def muon_adamw(model: nn.Module) -> MuonWithAdamW:
    """cx-zero's MuonWithAdamW over `muon_param_groups`: Muon on the hidden matrices, AdamW on the rest."""
    return MuonWithAdamW(muon_param_groups(model), lr=MUON_LR, weight_decay=0.01, adamw_lr=ADAMW_LR)


def freeze_all_but_matrices(model: nn.Module) -> nn.Module:
    """Freeze every parameter that is not 2-D (torch's Muon takes matrices only); returns `model`."""
    for param in model.parameters():
        param.requires_grad_(param.ndim == 2)
    return model


def regression_batch(step: int, world_size: int, outputs: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: PER_RANK rows of 8 inputs per rank and their `outputs` targets."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(PER_RANK * world_size, 8, generator=generator)
    return x, torch.randn(PER_RANK * world_size, outputs, generator=generator)


def rank_rows(rank: int) -> slice:
    """This rank's PER_RANK rows of a global batch."""
    return slice(rank * PER_RANK, (rank + 1) * PER_RANK)


def dp_share(plugin: HybridParallelPlugin | GeminiPlugin, step: int) -> dict[str, torch.Tensor]:
    """This dp rank's share of hybrid_test_helpers' `batch(step)`."""
    dp_rank, dp_size = plugin.data_parallel_rank_and_size()
    share = next(iter(batch(step).values())).shape[0] // dp_size
    return {k: v[dp_rank * share : (dp_rank + 1) * share] for k, v in batch(step).items()}


def _matrices_only_llama() -> nn.Module:
    return freeze_all_but_matrices(llama(layers=1))


def one_layer_llama() -> nn.Module:
    return llama(layers=1)


# the tp tests' cases: torch's Muon on a one-layer Llama's matrices alone, MuonWithAdamW on all of it
ONE_LAYER_CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.optim.Optimizer]]] = {
    "muon": (_matrices_only_llama, torch_muon),
    "muon_adamw": (one_layer_llama, muon_adamw),
}


def boosted_step(booster: Booster, loss: torch.Tensor, optimizer: OptimizerWrapper) -> None:
    """Backward through the booster, step, zero the gradients."""
    booster.backward(loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()


def reference_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """The single-process reference's backward, step and zeroing."""
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def save_and_load_fresh(
    booster: Booster,
    model: nn.Module,
    optimizer: OptimizerWrapper,
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    tmp_path: Path,
) -> tuple[nn.Module, OptimizerWrapper]:
    """Save `model` and `optimizer` through the checkpoint IO (sharded), boost a fresh pair from the two factories
    and load the checkpoint into it."""
    booster.save_model(model, tmp_path / "model", shard=True)
    booster.save_optimizer(optimizer, tmp_path / "optimizer", shard=True)
    torch.distributed.barrier()
    fresh = make_model()
    resumed, resumed_optimizer, *_ = booster.boost(fresh, make_optimizer(fresh))
    assert resumed_optimizer is not None
    booster.load_model(resumed, tmp_path / "model")
    booster.load_optimizer(resumed_optimizer, tmp_path / "optimizer")
    return resumed, resumed_optimizer
