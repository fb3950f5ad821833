"""The metadata cache is checked, and a changed shape is never fed stale.

A first stage whose output size depends on the data (rows kept per micro-batch; a stand-in for packing or dropping
padded rows) gives the same losses, gradients and evaluation outputs as the uncached transport and one process,
also when the size shrinks between micro-batches of one step and between steps; before, the receiver allocated
the probe's shape (stale rows in evaluation, a gloo abort in training). Stages deciding alone whether to re-probe
(each from its own batch) probed at different steps and waited for each other forever: the decision is now taken
together, and stages splitting their batches differently are refused by name.

Issue 37: after the first steps the stages agree only when a batch changes, and an edge whose metadata stayed the same
for `SETTLE_STEPS` steps is received without a host read of its header. A batch change after that re-probes (exact
results, no host read once settled again); a stage output that changes shape on a settled edge is named by its
sender."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cx_mesh import ProcessGroupMesh
from cx_mesh.testing import DistributedTestFailure, count_host_reads, distributed, run_distributed
from cx_pipeline import OneForwardOneBackwardSchedule, PipelineConfigError, PipelineStageManager, split_batch
from pipeline_helpers import batches

MICRO = 4  # rows per micro-batch


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, keep: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": torch.tanh(self.lin(x))[: int(keep[0])]}  # as many rows as the micro-batch says


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, keep: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(h)
        return out


def criterion(logits: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(logits, micro_batch["y"][: logits.shape[0]])


def make_batch(kept: list[int], seed: int, keep_dtype: torch.dtype = torch.int64) -> dict[str, torch.Tensor]:
    """Micro-batch i keeps kept[i] rows after the first stage."""
    generator = torch.Generator().manual_seed(seed)
    rows = MICRO * len(kept)
    keep = torch.tensor([k for k in kept for _ in range(MICRO)], dtype=keep_dtype)
    return {
        "x": torch.randn(rows, 4, generator=generator),
        "y": torch.randn(rows, 4, generator=generator),
        "keep": keep,
    }


def build(
    cache: bool, overlap: bool
) -> tuple[PipelineStageManager, OneForwardOneBackwardSchedule, nn.Module, nn.Module]:
    torch.manual_seed(0)
    first, last = First(), Last()
    manager = PipelineStageManager(ProcessGroupMesh(2, axis_names=("pp",)), "pp")
    schedule = OneForwardOneBackwardSchedule(
        manager, microbatch_size=MICRO, enable_metadata_cache=cache, overlap_p2p=overlap
    )
    return manager, schedule, first, last


def reference(first: nn.Module, last: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One process over the same micro-batches: (mean loss, backward done into .grad; concatenated logits)."""
    micro = split_batch(batch, batch["x"].shape[0] // MICRO)
    total, outputs = torch.zeros(()), list[torch.Tensor]()
    for mb in micro:
        logits = last(**mb, **first(**mb))
        loss = criterion(logits, mb) / len(micro)
        if torch.is_grad_enabled():
            loss.backward()
        total, outputs = total + loss.detach(), [*outputs, logits.detach()]
    return total, torch.cat(outputs)


@distributed(world_size=2)
@pytest.mark.parametrize(("cache", "overlap"), [(True, True), (True, False), (False, True)])
def test_stage_output_size_changing_with_the_data(rank: int, world_size: int, cache: bool, overlap: bool) -> None:
    manager, schedule, first, last = build(cache, overlap)
    ref_first, ref_last = First(), Last()
    ref_first.load_state_dict(first.state_dict())
    ref_last.load_state_dict(last.state_dict())
    mine = first if manager.stage == 0 else last
    expected_params = dict((ref_first if manager.stage == 0 else ref_last).named_parameters())
    for step, kept in enumerate([[4, 2], [1, 3], [4, 4, 2]]):  # shrinking and growing within and between steps
        batch = make_batch(kept, seed=step)
        mine.zero_grad()
        ref_first.zero_grad()
        ref_last.zero_grad()
        result = schedule.forward_backward_step(mine, batches(batch), criterion, return_loss=True)
        expected_loss, _ = reference(ref_first, ref_last, batch)
        if manager.stage == 1:
            torch.testing.assert_close(result["loss"], expected_loss, rtol=1e-6, atol=1e-7)
        for name, param in mine.named_parameters():
            assert param.grad is not None
            torch.testing.assert_close(param.grad, expected_params[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    for kept in ([2, 2], [4, 1]):  # evaluation: outputs of the sizes the data asks for
        batch = make_batch(kept, seed=9)
        with torch.no_grad():
            result = schedule.forward_backward_step(mine, batches(batch), criterion, return_outputs=True)
            _, expected_outputs = reference(ref_first, ref_last, batch)
        if manager.stage == 1:
            assert result["outputs"].shape == (sum(kept), 4)
            torch.testing.assert_close(result["outputs"], expected_outputs, rtol=1e-6, atol=1e-7)


@distributed(world_size=2, timeout=60)
def test_stages_re_probe_together(rank: int, world_size: int) -> None:
    """Only stage 0's batch changes its signature (the dtype of `keep`): every stage probes again at that step."""
    manager, schedule, first, last = build(True, True)
    mine = first if manager.stage == 0 else last
    for step in range(3):
        dtype = torch.int32 if step >= 1 and manager.stage == 0 else torch.int64
        result = schedule.forward_backward_step(
            mine, batches(make_batch([3, 2], step, dtype)), criterion, return_loss=True
        )
        assert (result["loss"] is not None) == (manager.stage == 1)


@distributed(world_size=2, timeout=60)
def test_stages_splitting_into_different_micro_batch_counts_are_refused(rank: int, world_size: int) -> None:
    manager, schedule, first, last = build(True, True)
    mine = first if manager.stage == 0 else last
    kept = [4, 4] if manager.stage == 0 else [4, 4, 4]
    with pytest.raises(PipelineConfigError, match="stage 0: 2, stage 1: 3"):
        schedule.forward_backward_step(mine, batches(make_batch(kept, 0)), criterion)
    result: dict[str, Any] = schedule.forward_backward_step(mine, batches(make_batch([4, 4], 0)), criterion)
    assert result["loss"] is None


def _train_step(
    manager: PipelineStageManager,
    schedule: OneForwardOneBackwardSchedule,
    mine: nn.Module,
    models: tuple[nn.Module, nn.Module],
    batch: dict[str, torch.Tensor],
) -> None:
    """One step on both stages, checked against one process (`models`: the reference first and last stages)."""
    mine.zero_grad()
    for model in models:
        model.zero_grad()
    result = schedule.forward_backward_step(mine, batches(batch), criterion, return_loss=True)
    expected_loss, _ = reference(*models, batch)
    if manager.stage == 1:
        torch.testing.assert_close(result["loss"], expected_loss, rtol=1e-6, atol=1e-7)
    expected = dict(models[manager.stage].named_parameters())
    for name, param in mine.named_parameters():
        assert param.grad is not None
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=1e-5, atol=1e-7, msg=name)


@distributed(world_size=2, timeout=60)
def test_settled_steps_read_nothing_and_a_batch_change_re_probes(rank: int, world_size: int) -> None:
    manager, schedule, first, last = build(True, True)
    models = (First(), Last())
    models[0].load_state_dict(first.state_dict())
    models[1].load_state_dict(last.state_dict())
    mine = first if manager.stage == 0 else last
    plan = [[4, 4]] * 4 + [[4, 4, 4]] * 4  # the batch grows after the edge settled: every stage sees the change
    with count_host_reads() as reads:
        for step, kept in enumerate(plan):
            if step in (3, 7):  # settled: nothing read in cx_pipeline
                reads.clear()
            _train_step(manager, schedule, mine, models, make_batch(kept, seed=step))
            if step in (3, 7):
                pipeline = {site: n for site, n in reads.cx().items() if site.startswith("cx_pipeline")}
                assert pipeline == {}, f"step {step}: {pipeline}"


def _output_shape_changes_on_a_settled_edge(rank: int, world_size: int) -> None:
    manager, schedule, first, last = build(True, True)
    mine = first if manager.stage == 0 else last
    for step, kept in enumerate([[4, 4]] * 4 + [[4, 2]]):  # same batch shapes: only the stage's output changes
        schedule.forward_backward_step(mine, batches(make_batch(kept, seed=step)), criterion)


def test_an_output_shape_change_on_a_settled_edge_is_named_by_its_sender() -> None:
    with pytest.raises(DistributedTestFailure) as failure:
        run_distributed(_output_shape_changes_on_a_settled_edge, 2, fresh=True, timeout=60)
    report = str(failure.value)
    assert "--- rank 0 raised" in report
    assert "the output of virtual stage 0 for micro-batch 1 is (2, 4) float32, but it was (4, 4) float32" in report
    assert "enable_metadata_cache=False" in report
