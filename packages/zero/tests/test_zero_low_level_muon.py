"""LowLevelZeroOptimizer around torch's Muon (each matrix stepped whole on one owner rank, `_whole_step`) against
torch's Muon on one process, ZeRO stage 1 and 2, over dp 2 and 4 (at 4 one rank owns no matrix).

Tolerance. The two runs' fp32 gradients differ by the order of the data-parallel sum (about 1e-7 relative). Muon
rounds its input to bf16 before Newton-Schulz (2**-8 relative), so that difference changes nothing unless an element
lies within it of a bf16 rounding boundary: multiplying every gradient element by (1 + 1e-6 * noise) changed no
parameter bit in 200 single-process runs of this model (3 steps), and the runs here are usually bit-identical. When
an element does round the other way, Newton-Schulz in bf16 carries it through the whole small matrix: with relative
noise 1e-5 and 1e-4 (a few, then 2.5 % of the elements rounding the other way every step) the worst of 200 runs
moved a parameter by 0.12 and 0.18 of its effective step lr * sqrt(max(1, rows / cols)). So the bound is 0.2 of
one effective step per parameter after the 3 steps. Orthogonalising slices instead (the bug this mechanism avoids)
is off by 0.19 to 0.54 of an effective step per element in a single step, and momentum carries it into the next.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cx_mesh.testing import distributed
from cx_zero import LowLevelZeroOptimizer, assign_owners, declare_whole_tensor, update_cost

LR, STEPS, PER_RANK = 0.02, 3, 3
FLIP_BOUND = 0.2  # of one effective step (module docs)


def _model() -> nn.Module:
    """A tall, a wide and a small odd-sized matrix: at dp 2 each straddles the two ranks' flat shards (the odd one,
    15 elements, also ends in padding)."""
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


def _reference(world_size: int) -> nn.Module:
    model = _model()
    optimizer = _muon(model)
    for step in range(STEPS):
        x, y = _batch(step, world_size)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def assert_muon_close(model: nn.Module, reference: nn.Module) -> None:
    """Every parameter within `FLIP_BOUND` effective steps of the reference's (module docs)."""
    lrs = (2 * LR, LR, LR)  # `_muon`'s groups
    for (name, mine), want, lr in zip(model.named_parameters(), reference.parameters(), lrs, strict=True):
        rows, cols = want.shape
        step = lr * math.sqrt(max(1.0, rows / cols))
        torch.testing.assert_close(mine.detach(), want.detach(), rtol=0, atol=FLIP_BOUND * step, msg=name)


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_muon_matches_one_process(rank: int, world_size: int, stage: int) -> None:
    model = _model()
    optimizer = LowLevelZeroOptimizer(_muon(model), partition_grad=stage == 2, reduce_bucket_size=7)
    for step in range(STEPS):
        x, y = _batch(step, world_size)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        optimizer.backward(nn.functional.mse_loss(model(x[mine]), y[mine]))
        optimizer.step()
        optimizer.zero_grad()
    assert_muon_close(model, _reference(world_size))
    # the momentum is sharded by matrix: each of the 3 matrices' buffers lives whole on exactly one rank
    buffers = [s["momentum_buffer"] for s in optimizer.optim.state.values()]
    assert all(b.dim() == 2 for b in buffers)
    held = torch.tensor([len(buffers)])
    dist.all_reduce(held)
    assert int(held) == 3


class _RecordsShapes(torch.optim.SGD):
    """SGD that notes the shape of every gradient it steps (declared whole-tensor: it must see whole matrices)."""

    seen: list[tuple[int, ...]]

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.seen.extend(tuple(p.grad.shape) for g in self.param_groups for p in g["params"] if p.grad is not None)
        super().step()


@distributed(world_size=2)
def test_zero_declared_whole_tensor_optimizer_steps_whole_parameters(rank: int, world_size: int) -> None:
    model = _model()
    inner = _RecordsShapes(model.parameters(), lr=LR)
    inner.seen = []
    optimizer = LowLevelZeroOptimizer(declare_whole_tensor(inner))
    x, y = _batch(0, world_size)
    optimizer.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    seen: list[list[tuple[int, ...]]] = [[] for _ in range(world_size)]
    dist.all_gather_object(seen, sorted(inner.seen))
    assert sorted(s for shapes in seen for s in shapes) == [(3, 5), (5, 12), (12, 8)]  # each whole, once


def test_zero_owners_balance_newton_schulz_cost() -> None:
    assert update_cost((12, 8)) == 12 * 8 * 8
    assert update_cost((7,)) == 7
    shapes = [(64, 64), (8, 8), (64, 16), (16, 64), (8, 8)]
    assert assign_owners(shapes, 2) == [0, 1, 1, 1, 1]  # the 64 x 64 outweighs all the others together
    assert assign_owners([(32, 32)] * 4 + [(16, 16)] * 2, 2) == [0, 1, 0, 1, 0, 1]  # equal costs alternate
    assert assign_owners([(4, 4)], 3) == [0]  # more ranks than matrices: some own nothing


def _trained(rank: int, world_size: int, steps: int, dtype: torch.dtype, stage: int, group: dist.ProcessGroup | None,
             model: nn.Module | None = None) -> tuple[nn.Module, LowLevelZeroOptimizer]:  # fmt: skip
    """A model (given, or fresh) under LowLevelZero + Muon over `group`, trained `steps` steps from step 0."""
    model = _model().to(dtype) if model is None else model
    optimizer = LowLevelZeroOptimizer(_muon(model), partition_grad=stage == 2, dp_process_group=group, module=model)
    _train(rank, world_size, model, optimizer, range(steps), dtype)
    return model, optimizer


def _train(rank: int, world_size: int, model: nn.Module, optimizer: LowLevelZeroOptimizer, steps: range,
           dtype: torch.dtype) -> None:  # fmt: skip
    for step in steps:
        x, y = _batch(step, 2)  # the global batch of dp 2; a dp-1 group trains on all of it
        share = 2 * PER_RANK // world_size
        mine = slice(rank * share, (rank + 1) * share)
        optimizer.backward(nn.functional.mse_loss(model(x[mine].to(dtype)).float(), y[mine]))
        optimizer.step()
        optimizer.zero_grad()


@distributed(world_size=2)
@pytest.mark.parametrize(("dtype", "stage"), [(torch.float32, 2), (torch.bfloat16, 1)])
def test_zero_muon_state_round_trip_resumes_bit_exactly(
    rank: int, world_size: int, dtype: torch.dtype, stage: int
) -> None:
    """Momentum (whole, on its owner) and, in bf16, the fp32 masters saved by name and loaded into a fresh optimizer:
    the next step is bit-identical to the uninterrupted run's."""
    straight, straight_optimizer = _trained(rank, world_size, 2, dtype, stage, None)
    saved = straight_optimizer.state_dict()
    assert {k for v in saved["state"].values() for k in v} == (
        {"momentum_buffer"} if dtype == torch.float32 else {"momentum_buffer", "master_weight"}
    )
    assert all(
        v["momentum_buffer"].shape == p.shape
        for (_, p), v in zip(straight.named_parameters(), saved["state"].values(), strict=True)
    )
    resumed = _model().to(dtype)
    resumed.load_state_dict(straight.state_dict())
    resumed_optimizer = LowLevelZeroOptimizer(_muon(resumed), partition_grad=stage == 2, module=resumed)
    resumed_optimizer.load_state_dict(saved)
    for model, optimizer in ((straight, straight_optimizer), (resumed, resumed_optimizer)):
        _train(rank, world_size, model, optimizer, range(2, 3), dtype)
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name


@distributed(world_size=2)
def test_zero_muon_state_saved_at_dp2_continues_at_dp1(rank: int, world_size: int) -> None:
    """The full-by-name state of dp 2 loads into dp 1 (each rank its own one-replica group, the momentum then a
    view-stepped whole on every rank) and continues like dp 2 within the Newton-Schulz bound."""
    straight, straight_optimizer = _trained(rank, world_size, 2, torch.float32, 2, None)
    saved = straight_optimizer.state_dict()
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    single = _model()
    single.load_state_dict(straight.state_dict())
    single_optimizer = LowLevelZeroOptimizer(_muon(single), dp_process_group=alone, module=single)
    single_optimizer.load_state_dict(saved)
    _train(rank, world_size, straight, straight_optimizer, range(2, 3), torch.float32)
    _train(0, 1, single, single_optimizer, range(2, 3), torch.float32)
    assert_muon_close(single, straight)
