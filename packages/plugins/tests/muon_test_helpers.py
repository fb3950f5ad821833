"""Shared pieces of the plugin Muon tests: their learning rates and steps, the flipped-rounding bound (0.2 of one
effective step lr * sqrt(max(1, rows / cols)) per Muon matrix, 0.2 of lr per step taken per AdamW parameter; derived
in packages/zero/tests/test_zero_low_level_muon.py and test_plugins_zero_muon_adamw.py), the tiny matrix model with
its batches, the optimizers on both sides, one training step each side, and the save / load into a fresh boosted pair
that each test then steps beside the original to check a bit-exact resume."""

from __future__ import annotations

import copy
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
# bf16 working weights: their gradients differ between summation orders (tp partial sums, the dp average) by about
# half a bf16 ulp (2**-8 relative) per element, not fp32's 1e-7, so many of Newton-Schulz's bf16 inputs round the
# other way. One process's emulated mixed-precision run of the one-layer Llama (`bf16_reference_step`, 3 steps) with
# every gradient element multiplied by (1 + 2**-8 * uniform(-1, 1)) moved a Muon matrix by at most 0.41 of one
# effective step in 100 seeded runs (o_proj); the bound is 0.5 of one, after rounding both sides to bf16 (BF16_RTOL:
# one bf16 spacing, 2**-7 relative, as two roundings of nearby masters can land one spacing apart).
BF16_FLIP_BOUND, BF16_RTOL = 0.5, 2**-7


def muon_bound(lr: float, rows: int, cols: int, *, flip: float = FLIP_BOUND) -> float:
    """`flip` (0.2, or BF16_FLIP_BOUND) of one effective Muon step of a rows x cols matrix at `lr`."""
    return flip * lr * math.sqrt(max(1.0, rows / cols))


def assert_close_bf16(got: torch.Tensor, master: torch.Tensor, bound: float, name: str) -> None:
    """A bf16 working weight against one process's fp32 master rounded to bf16: within `bound` plus one bf16
    spacing of the value."""
    want = master.detach().to(torch.bfloat16).float()
    torch.testing.assert_close(got.detach().float(), want, rtol=BF16_RTOL, atol=bound, msg=name)


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


def dp_shares(step: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
    """Every dp rank's share of hybrid_test_helpers' `batch(step)`, in dp rank order."""
    whole = batch(step)
    share = next(iter(whole.values())).shape[0] // dp_size
    return [{k: v[r * share : (r + 1) * share] for k, v in whole.items()} for r in range(dp_size)]


def bf16_reference_step(
    reference: nn.Module, optimizer: torch.optim.Optimizer, shares: list[dict[str, torch.Tensor]]
) -> None:
    """One mixed-precision step emulated on one process: each dp rank's share through a bf16 copy of the fp32
    masters, the bf16 gradients summed and averaged in bf16, the optimizer stepping the fp32 masters."""
    total: list[torch.Tensor | None] = [None for _ in reference.parameters()]
    for share in shares:
        work = copy.deepcopy(reference).to(torch.bfloat16)
        work(**share).loss.backward()
        for index, param in enumerate(work.parameters()):
            summed = total[index]
            if param.grad is not None:
                total[index] = param.grad if summed is None else summed + param.grad
    for param, grad in zip(reference.parameters(), total, strict=True):
        param.grad = None if grad is None else (grad / len(shares)).float()
    optimizer.step()
    optimizer.zero_grad()


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
