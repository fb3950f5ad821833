"""Backward through the optimizer (ColossalAI's contract): the loss scale reaches every stage once, and gradients
are reduced once per step (the `no_sync` protocol), tied parameters included.

`ScalingReducer` stands in for a ZeRO optimizer: `backward` scales the loss, `backward_by_grad` takes the already
scaled gradient, and a post-accumulate hook "reduces" (records) a parameter's gradient whenever a backward runs
outside `no_sync`. The schedule must leave exactly one reduction per parameter per step, holding the full gradient
of the step (tied parameters: summed over both stages), times the scale.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_pipeline import split_model
from pipeline_helpers import (
    ToyNet,
    batches,
    build_schedule,
    names_by_identity,
    reference_step,
    toy_batch,
    toy_criterion,
)

SCALE = 64.0


class ScalingReducer:
    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.sync = True
        self.reduced: dict[int, list[torch.Tensor]] = {}
        for param in params:
            param.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, param: torch.Tensor) -> None:
        if self.sync:
            assert param.grad is not None
            self.reduced.setdefault(id(param), []).append(param.grad.clone())

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def backward(self, loss: torch.Tensor, inputs: Any = None, retain_graph: bool = False) -> None:
        torch.autograd.backward(loss * SCALE, inputs=inputs, retain_graph=retain_graph)

    def backward_by_grad(self, tensor: Any, grad: Any, inputs: Any = None, retain_graph: bool = False) -> None:
        torch.autograd.backward(tensor, grad, inputs=inputs, retain_graph=retain_graph)


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("style", ["1f1b", "interleaved", "zbv"])
def test_optimizer_backward_scales_once_and_reduces_once(rank: int, world_size: int, style: str, tied: bool) -> None:
    torch.manual_seed(0)
    full = ToyNet(2 * world_size, tied=tied)
    reference = copy.deepcopy(full)
    manager, schedule = build_schedule(style, world_size, world_size)
    model = split_model(full, manager)
    params = list({id(p): p for p in model.parameters()}.values())
    optimizer = ScalingReducer(params)
    batch = toy_batch(2 * world_size, tied, True, seed=1)
    result = schedule.forward_backward_step(model, batches(batch), toy_criterion, optimizer, return_loss=True)
    expected_loss = reference_step(reference, batch, world_size, toy_criterion)
    if result["loss"] is not None:
        torch.testing.assert_close(result["loss"], expected_loss, atol=1e-6, rtol=1e-5)
    names = names_by_identity(full)
    expected = dict(reference.named_parameters())
    for param in params:
        name = names[id(param)]
        reductions = optimizer.reduced.get(id(param), [])
        assert len(reductions) == 1, f"{name} reduced {len(reductions)} times in one step"
        want = expected[name].grad
        assert want is not None
        torch.testing.assert_close(reductions[0], want * SCALE, atol=1e-4, rtol=1e-4)


class PlainOptimizer:
    """backward / backward_by_grad without the inputs= keyword: fine for 1F1B, refused by the V schedule."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        torch.autograd.backward(tensor, grad)


@distributed(world_size=2)
def test_plain_optimizer_drives_1f1b(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    full = ToyNet(4)
    reference = copy.deepcopy(full)
    manager, schedule = build_schedule("1f1b", world_size, 3)
    model = split_model(full, manager)
    batch = toy_batch(6, False, True, seed=2)
    schedule.forward_backward_step(model, batches(batch), toy_criterion, PlainOptimizer())
    reference_step(reference, batch, 3, toy_criterion)
    expected = dict(reference.named_parameters())
    names = names_by_identity(full)
    for param in model.parameters():
        want = expected[names[id(param)]].grad
        assert want is not None
        assert param.grad is not None
        torch.testing.assert_close(param.grad, want, atol=1e-5, rtol=1e-4)
