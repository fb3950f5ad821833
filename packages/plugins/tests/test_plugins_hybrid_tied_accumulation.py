"""Gradient accumulation over several `execute_pipeline` calls before one `step()`, on HF GPT-2 at pp 2, whose input
embedding (first stage) and LM head (last stage) are one tied parameter: the tie's gradient must be summed over the
two stages once per call's contribution. Summing the whole accumulated `.grad` again in every call counted call 1
twice after two calls (four times after three). At zero 0 the gradients accumulate until the step anyway; at ZeRO-1/2
the earlier calls run under `booster.no_sync`. Compared with one process accumulating the same micro-batches: every
call's loss, the clipped gradient norm and every parameter after two optimizer steps."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from cx_mesh.testing import distributed
from cx_plugins import Booster, HybridParallelModule, HybridParallelPlugin
from hybrid_test_helpers import LR, batch, compare_parameters, gpt2

pytest.importorskip("transformers")

STEPS = 2
CLIP = 0.05  # below the gradient norm of every step here, so clipping scales every gradient


@distributed(world_size=2)
@pytest.mark.parametrize(("zero_stage", "calls"), [(0, 2), (0, 3), (1, 2), (2, 3)])
def test_tied_gradient_accumulated_over_pipeline_calls(rank: int, world_size: int, zero_stage: int, calls: int) -> None:
    model = gpt2()
    reference = copy.deepcopy(model)
    plugin = HybridParallelPlugin(precision="fp32", zero_stage=zero_stage, tp_size=1, pp_size=2, num_microbatches=2)
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    losses, reference_losses, norms, reference_norms = [], [], [], []
    for step in range(STEPS):
        for call in range(calls):
            data = batch(step * calls + call)
            last_call = call == calls - 1
            deferred = booster.no_sync(boosted, optimizer) if zero_stage > 0 and not last_call else None
            with deferred if deferred is not None else contextlib.nullcontext():
                result = booster.execute_pipeline(
                    iter([data]), boosted, lambda out, _mb: out.loss, optimizer, return_loss=True
                )
            reference_loss = reference(**data).loss
            reference_loss.backward()  # the mean over the call's micro-batches, as the pipeline's loss
            if result["loss"] is not None:
                losses.append(float(result["loss"]))
                reference_losses.append(float(reference_loss.detach()))
        norms.append(float(optimizer.clip_grad_by_norm(CLIP)))
        reference_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert min(reference_norms) > CLIP
    assert plugin.stage_manager is not None
    assert len(losses) == (STEPS * calls if plugin.stage_manager.is_last_stage() else 0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(reference_norms), rtol=1e-4, atol=1e-6)
    compare_parameters(boosted, reference, plugin, rtol=1e-4, atol=1e-5)
