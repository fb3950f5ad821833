"""Every schedule against a single process on the same micro-batches: the loss and every gradient, over two SGD
steps, on 2 and 4 stages; micro-batch counts one below, equal to and one above the stage count; tensor and dict
batches; even, uneven and explicit layer splits."""

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


def _run_against_reference(
    world_size: int,
    style: str,
    num_microbatches: int,
    num_layers: int,
    as_dict: bool,
    layers_per_stage: list[int] | None = None,
    tied: bool = False,
    steps: int = 2,
    metadata_cache: bool = True,
    overlap_p2p: bool = True,
    release_other_stages: bool = False,
) -> None:
    torch.manual_seed(0)
    full = ToyNet(num_layers, tied=tied)
    reference = copy.deepcopy(full)
    manager, schedule = build_schedule(
        style, world_size, num_microbatches, layers_per_stage, metadata_cache, overlap_p2p
    )
    model = split_model(full, manager, release_other_stages=release_other_stages)
    if release_other_stages:  # what other ranks hold has no storage here; what this rank holds is untouched
        mine = {id(p) for p in model.parameters()}
        assert mine
        for name, param in full.named_parameters():
            assert (param.device.type == "meta") != (id(param) in mine), name
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        batch = toy_batch(2 * num_microbatches, tied, as_dict, seed=step)
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
        result = schedule.forward_backward_step(model, batches(batch), toy_criterion, return_loss=True)
        expected = reference_step(reference, batch, num_microbatches, toy_criterion)
        holds_loss = manager.locate_virtual_stage(manager.num_virtual_stages - 1)[0] == manager.stage
        if holds_loss:
            torch.testing.assert_close(result["loss"], expected, atol=1e-6, rtol=1e-5)
        else:
            assert result["loss"] is None
        assert assert_grads_match(model, full, reference) > 0
        optimizer.step()
        reference_optimizer.step()


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("offset", [-1, 0, 1], ids=["stages-1", "stages", "stages+1"])
@pytest.mark.parametrize("style", ["1f1b", "zbv"])
def test_schedule_matches_single_process(rank: int, world_size: int, style: str, offset: int) -> None:
    num_microbatches = world_size + offset
    layers = 2 * world_size if style == "zbv" else world_size + 1  # uneven for 1F1B: the remainder goes mid-pipe
    _run_against_reference(world_size, style, num_microbatches, layers, as_dict=True)


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("multiple", [1, 2])
def test_interleaved_matches_single_process(rank: int, world_size: int, multiple: int) -> None:
    _run_against_reference(world_size, "interleaved", multiple * world_size, 2 * world_size + 1, as_dict=True)


@distributed(world_size=2)
@pytest.mark.parametrize("style", ["1f1b", "interleaved", "zbv"])
def test_tensor_batches(rank: int, world_size: int, style: str) -> None:
    _run_against_reference(world_size, style, 4, 5, as_dict=False)


@distributed(world_size=2)
@pytest.mark.parametrize("style", ["1f1b", "interleaved", "zbv"])
def test_without_metadata_cache(rank: int, world_size: int, style: str) -> None:
    """Metadata sent with every activation message instead of once: same results."""
    _run_against_reference(world_size, style, 4, 4, as_dict=True, metadata_cache=False)


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("style", ["1f1b", "interleaved", "zbv"])
@pytest.mark.parametrize("metadata_cache", [True, False], ids=["cached", "uncached"])
def test_without_p2p_overlap(rank: int, world_size: int, style: str, metadata_cache: bool) -> None:
    """overlap_p2p=False: every receive posted and waited for when its action needs it, the order run as listed."""
    _run_against_reference(
        world_size, style, world_size, 2 * world_size, as_dict=True, metadata_cache=metadata_cache, overlap_p2p=False
    )


@distributed(world_size=2)
@pytest.mark.parametrize(
    ("style", "layers_per_stage"),
    [("1f1b", [1, 4]), ("1f1b", [4, 1]), ("interleaved", [2, 1, 1, 3]), ("zbv", [1, 2, 3, 1])],
)
def test_explicit_uneven_layers(rank: int, world_size: int, style: str, layers_per_stage: list[int]) -> None:
    _run_against_reference(world_size, style, 2, sum(layers_per_stage), as_dict=True, layers_per_stage=layers_per_stage)


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("style", ["1f1b", "interleaved", "zbv"])
def test_tied_embeddings_across_first_and_last_stage(rank: int, world_size: int, style: str) -> None:
    """The embedding on the first stage and the head on the last are one value: gradients summed, same update."""
    _run_against_reference(world_size, style, world_size, 2 * world_size, as_dict=True, tied=True, steps=3)


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("style", ["1f1b", "interleaved", "zbv"])
def test_release_other_stages(rank: int, world_size: int, style: str) -> None:
    """split_model(..., release_other_stages=True) frees the other ranks' layers (meta device) and trains the same,
    tied embedding included."""
    _run_against_reference(
        world_size, style, world_size, 2 * world_size, as_dict=True, tied=True, release_other_stages=True
    )


@distributed(world_size=2)
def test_evaluation_runs_forward_only_and_merges_outputs(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    full = ToyNet(4)
    reference = copy.deepcopy(full)
    manager, schedule = build_schedule("1f1b", world_size, 4)
    model = split_model(full, manager)
    batch = toy_batch(8, False, True, seed=3)
    with torch.no_grad():
        result = schedule.forward_backward_step(
            model, batches(batch), toy_criterion, return_loss=True, return_outputs=True
        )
        expected = reference(**batch)
    assert all(p.grad is None for p in model.parameters())
    if manager.stage == world_size - 1:
        torch.testing.assert_close(result["outputs"]["logits"], expected["logits"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result["loss"], toy_criterion(expected, batch), atol=1e-6, rtol=1e-5)
    else:
        assert result["outputs"] is None
        assert result["loss"] is None
