"""A parameter tied over the first and last stages, with gradients accumulated over several steps before comparing
(no optimizer step in between): each step's contribution is summed over the stages once. Summing the whole
accumulated `.grad` in every step counted the first step twice after two steps, four times after three."""

from __future__ import annotations

import copy

import pytest
import torch

from cx_mesh.testing import distributed
from cx_pipeline import split_model
from pipeline_helpers import (
    ToyNet,
    assert_grads_match,
    batches,
    build_schedule,
    reference_step,
    toy_batch,
    toy_criterion,
)


@distributed(world_size=2)
@pytest.mark.parametrize("steps", [2, 3])
@pytest.mark.parametrize("style", ["1f1b", "interleaved"])
def test_tied_gradient_accumulated_over_steps(rank: int, world_size: int, style: str, steps: int) -> None:
    torch.manual_seed(0)
    full = ToyNet(4, tied=True)
    reference = copy.deepcopy(full)
    manager, schedule = build_schedule(style, world_size, 2)
    model = split_model(full, manager)
    for step in range(steps):
        batch = toy_batch(4, tied=True, as_dict=True, seed=step)
        schedule.forward_backward_step(model, batches(batch), toy_criterion)
        reference_step(reference, batch, 2, toy_criterion)
    assert assert_grads_match(model, full, reference) > 0
