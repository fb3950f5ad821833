"""Each bad configuration raises a clear `PipelineConfigError` on every rank, never a hang, and the pipeline's
channels stay usable afterwards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh import ProcessGroupMesh
from cx_mesh.testing import distributed
from cx_pipeline import (
    EmptyDataIterError,
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineConfigError,
    PipelineStageManager,
    ZeroBubbleVPipeScheduler,
    split_model,
)
from pipeline_helpers import ToyNet, batches, build_schedule, toy_batch, toy_criterion


class _RenameOutput(nn.Module):
    """Wraps a stage so that it sends `hidden` instead of the `hidden_states` the next stage takes."""

    def __init__(self, inner: nn.Module, as_tensor: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.as_tensor = as_tensor

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        out = self.inner(x, y)
        if self.as_tensor:
            return out["hidden_states"]
        return {"hidden": out["hidden_states"], "aux": out["aux"]}


@distributed(world_size=(2, 4))
def test_interleaved_needs_a_multiple_of_the_stages(rank: int, world_size: int) -> None:
    _, schedule = build_schedule("interleaved", world_size, world_size + 1)
    model = split_model(ToyNet(2 * world_size), schedule.stage_manager)
    batch = toy_batch(world_size + 1, False, True, seed=0)
    with pytest.raises(PipelineConfigError, match=r"multiple of the \d pipeline stages, got \d; use e\.g\."):
        schedule.forward_backward_step(model, batches(batch), toy_criterion)


@distributed(world_size=2)
@pytest.mark.parametrize(("count", "size"), [(2, None), (None, 2)])
def test_batch_size_not_divisible(rank: int, world_size: int, count: int | None, size: int | None) -> None:
    manager = PipelineStageManager(ProcessGroupMesh(2, axis_names=("pp",)), "pp")
    schedule = OneForwardOneBackwardSchedule(manager, num_microbatches=count, microbatch_size=size)
    model = split_model(ToyNet(2), manager)
    with pytest.raises(PipelineConfigError, match="batch size 5 is not divisible"):
        schedule.forward_backward_step(model, batches(toy_batch(5, False, True, seed=0)), toy_criterion)


@distributed(world_size=2)
def test_empty_data_iterator(rank: int, world_size: int) -> None:
    """No batch left for the step: a StopIteration (as before, so epoch loops that catch it still end) that says
    what ran dry; the schedule runs the next step with a batch."""
    manager = PipelineStageManager(ProcessGroupMesh(2, axis_names=("pp",)), "pp")
    schedule = OneForwardOneBackwardSchedule(manager, num_microbatches=2)
    model = split_model(ToyNet(2), manager)
    empties: list[Any] = [iter([]), []]
    for empty in empties:
        with pytest.raises(EmptyDataIterError, match="data iterator is empty or exhausted") as caught:
            schedule.forward_backward_step(model, empty, toy_criterion)
        assert isinstance(caught.value, StopIteration)
    data = batches(toy_batch(4, False, True, seed=0))
    result = schedule.forward_backward_step(model, data, toy_criterion, return_loss=True)
    assert (result["loss"] is not None) == manager.is_last_stage()


@distributed(world_size=(2, 4))
def test_fewer_layers_than_stages(rank: int, world_size: int) -> None:
    manager, _ = build_schedule("1f1b", world_size, world_size)
    with pytest.raises(PipelineConfigError, match=f"fewer than the {world_size} pipeline slots"):
        split_model(ToyNet(world_size - 1), manager)


@distributed(world_size=2)
def test_layers_per_stage_must_sum_to_the_layers(rank: int, world_size: int) -> None:
    manager, _ = build_schedule("1f1b", world_size, 2, layers_per_stage=[2, 2])
    with pytest.raises(PipelineConfigError, match=r"sums to 4, but the model has 5 layers"):
        split_model(ToyNet(5), manager)


@distributed(world_size=2)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["wrong-names", "not-a-dict"])
def test_stage_output_not_what_the_next_stage_takes(rank: int, world_size: int, as_tensor: bool) -> None:
    manager, schedule = build_schedule("1f1b", world_size, 2)
    model = split_model(ToyNet(2), manager)
    good = model.chunks[0]
    if manager.stage == 0:
        model.chunks[0] = _RenameOutput(good, as_tensor)
    batch = toy_batch(4, False, True, seed=0)
    message = "it returned a Tensor; a stage that is not the last must return a dict" if as_tensor else "hidden"
    with pytest.raises(PipelineConfigError, match=message):
        schedule.forward_backward_step(model, batches(batch), toy_criterion)
    model.chunks[0] = good  # fixed: the same schedule runs (the failed check left no message behind)
    result = schedule.forward_backward_step(model, batches(batch), toy_criterion, return_loss=True)
    assert (result["loss"] is not None) == (manager.stage == 1)


@distributed(world_size=2)
def test_criterion_error_reaches_every_rank(rank: int, world_size: int) -> None:
    manager, schedule = build_schedule("zbv", world_size, 2)
    model = split_model(ToyNet(4), manager)

    def broken(outputs: Any, micro_batch: Any) -> torch.Tensor:
        return outputs["missing"]  # type: ignore[no-any-return]

    with pytest.raises(PipelineConfigError, match="KeyError"):
        schedule.forward_backward_step(model, batches(toy_batch(4, False, True, seed=0)), broken)


class _NoInputsOptimizer:
    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        torch.autograd.backward(tensor, grad)


@distributed(world_size=2)
def test_zero_bubble_needs_split_backward_in_the_optimizer(rank: int, world_size: int) -> None:
    manager, schedule = build_schedule("zbv", world_size, 2)
    model = split_model(ToyNet(4), manager)
    with pytest.raises(PipelineConfigError, match="must accept inputs= and retain_graph="):
        schedule.forward_backward_step(
            model, batches(toy_batch(4, False, True, seed=0)), toy_criterion, _NoInputsOptimizer()
        )


@distributed(world_size=2)
def test_schedule_and_stage_manager_must_agree(rank: int, world_size: int) -> None:
    mesh = ProcessGroupMesh(2, axis_names=("pp",))
    plain = PipelineStageManager(mesh, "pp")
    interleaved = PipelineStageManager(mesh, "pp", enable_interleave=True, num_model_chunks=2)
    with pytest.raises(PipelineConfigError, match="enable_interleave=True"):
        InterleavedSchedule(plain, num_model_chunks=1, num_microbatch=2)
    with pytest.raises(PipelineConfigError, match="one chunk per stage"):
        OneForwardOneBackwardSchedule(interleaved, num_microbatches=2)
    with pytest.raises(PipelineConfigError, match="use_zbv=True"):
        ZeroBubbleVPipeScheduler(interleaved, num_microbatch=2)
    with pytest.raises(PipelineConfigError, match="num_microbatches or microbatch_size"):
        OneForwardOneBackwardSchedule(plain)
    with pytest.raises(PipelineConfigError, match="use_zbv needs num_model_chunks=2"):
        PipelineStageManager(mesh, "pp", use_zbv=True, num_model_chunks=3)
    with pytest.raises(PipelineConfigError, match="needs enable_interleave=True"):
        PipelineStageManager(mesh, "pp", num_model_chunks=2)
    with pytest.raises(PipelineConfigError, match="must list 4 positive layer counts"):
        PipelineStageManager(mesh, "pp", enable_interleave=True, num_model_chunks=2, num_layers_per_stage=[1, 2])
    schedule = InterleavedSchedule(interleaved, num_model_chunks=2, num_microbatch=2)
    with pytest.raises(PipelineConfigError, match="runs 2 model chunk"):
        schedule.forward_backward_step(nn.Linear(2, 2), batches(torch.zeros(2, 2)), toy_criterion)
