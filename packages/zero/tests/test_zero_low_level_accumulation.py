"""Gradient accumulation: k micro-batches (inside `no_sync()` or reduced each time) equal one step on the k-fold
batch, in stage 1 and stage 2."""

from __future__ import annotations

import pytest
import torch

from cx_mesh.testing import distributed
from cx_zero import LowLevelZeroOptimizer
from zero_test_helpers import Reference, assert_params_close, batch, bound_loss, clone_model, local, loss_of, make_model

MICRO = 3


def _micro(step: int, micro: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch("mlp", 100 * step + micro, world_size)


@distributed(world_size=2)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("use_no_sync", [True, False])
def test_zero_accumulation_equals_one_big_step(rank: int, world_size: int, stage: int, use_no_sync: bool) -> None:
    model = make_model("mlp")
    reference = Reference(clone_model(model))
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
        partition_grad=stage == 2,
        overlap_communication=True,
        reduce_bucket_size=30,
    )
    for step in range(2):
        optimizer.zero_grad()
        for micro in range(MICRO):
            x, y = _micro(step, micro, world_size)
            loss = loss_of("mlp", model, local(x, rank, world_size), local(y, rank, world_size)) / MICRO
            if use_no_sync and micro < MICRO - 1:
                with optimizer.no_sync():
                    optimizer.backward(loss)
                assert all(p.grad is not None for p in model.parameters()), "no_sync keeps local gradients"
            else:
                optimizer.backward(loss)
                assert all(p.grad is None for p in model.parameters()), "reduced gradients leave the parameters"
        optimizer.step()
        # Reference: one step on the whole k-fold batch (mean loss over every rank's every micro-batch).
        xs = [_micro(step, m, world_size) for m in range(MICRO)]
        x_all = torch.cat([x for x, _ in xs])
        y_all = torch.cat([y for _, y in xs])
        grads = reference.grads_of(bound_loss("mlp", x_all, y_all))
        reference.step(grads)
        assert_params_close(model, reference.model, 1e-5, 1e-6, f"step {step}")
