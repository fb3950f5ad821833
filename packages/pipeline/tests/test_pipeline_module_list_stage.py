"""A stage given as an `nn.ModuleList` subclass with its own `forward` is one model chunk, as ColossalAI's 1F1B runs
it (ColossalAI's test_oneF_oneB passes its stage that way); a plain `nn.ModuleList` (no forward of its own) is still
a list of chunks, one per virtual stage."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_pipeline import PipelineConfigError, PipelineModel, split_model
from pipeline_helpers import ToyNet, batches, build_schedule, toy_batch, toy_criterion


class _LayersWithForward(nn.ModuleList):
    """A stage holding its layers in a ModuleList that runs them itself (the first one; the second is a spare)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self[0](*args, **kwargs)


@distributed(world_size=2)
def test_pipeline_module_list_with_forward_is_one_chunk(rank: int, world_size: int) -> None:
    manager, schedule = build_schedule("1f1b", world_size, 2)
    split = split_model(ToyNet(2), manager)
    assert isinstance(split, PipelineModel)
    assert not split.shared  # untied: the bare chunk runs what the PipelineModel runs
    batch = toy_batch(4, False, True, seed=0)
    plain = schedule.forward_backward_step(split.chunks[0], batches(batch), toy_criterion, return_loss=True)
    plain_grads = [p.grad.clone() for p in split.chunks[0].parameters() if p.grad is not None]
    split.chunks[0].zero_grad(set_to_none=True)
    stage = _LayersWithForward([split.chunks[0], nn.Linear(2, 2)])
    listed = schedule.forward_backward_step(stage, batches(batch), toy_criterion, return_loss=True)
    listed_grads = [p.grad for p in split.chunks[0].parameters() if p.grad is not None]
    if manager.is_last_stage():
        torch.testing.assert_close(listed["loss"], plain["loss"], rtol=0, atol=0)
    assert len(listed_grads) == len(plain_grads) > 0
    for got, want in zip(listed_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(PipelineConfigError, match="this stage was given 2"):  # a plain list: two chunks
        schedule.forward_backward_step(nn.ModuleList([split.chunks[0], nn.Linear(2, 2)]), batches(batch), toy_criterion)
