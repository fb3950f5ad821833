"""cx-pipeline's schedules driving cx-zero's LowLevelZeroOptimizer (the combination the hybrid plugins build): each
stage's optimizer runs the backward (`backward` on the last stage, `backward_by_grad` elsewhere, with `inputs=` for
the zero-bubble split), and two training steps of an HF Llama in two stages match single-process SGD."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cx_mesh import ProcessGroupMesh
from cx_mesh.testing import distributed
from cx_pipeline import (
    HFDecoderSplitter,
    OneForwardOneBackwardSchedule,
    PipelineStageManager,
    ZeroBubbleVPipeScheduler,
    split_model,
)
from cx_zero import LowLevelZeroOptimizer

transformers = pytest.importorskip("transformers")

LR = 0.05


def _llama(layers: int) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32, num_hidden_layers=layers, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _forever(batch: Any) -> Iterator[Any]:
    while True:
        yield batch


def _loss(outputs: Any, _micro_batch: Any) -> torch.Tensor:
    loss: torch.Tensor = outputs.loss
    return loss


@distributed(world_size=2)
@pytest.mark.parametrize("style", ["1f1b", "zbv"])
@pytest.mark.parametrize("stage", [1, 2])
def test_pipeline_schedules_drive_low_level_zero(rank: int, world_size: int, style: str, stage: int) -> None:
    mesh = ProcessGroupMesh(1, world_size, axis_names=("dp", "pp"))
    if style == "1f1b":
        manager = PipelineStageManager(mesh, "pp")
        schedule: Any = OneForwardOneBackwardSchedule(manager, num_microbatches=2)
    else:
        manager = PipelineStageManager(mesh, "pp", use_zbv=True, num_model_chunks=2)
        schedule = ZeroBubbleVPipeScheduler(manager, num_model_chunks=2, num_microbatch=2)
    full = _llama(4)
    reference = copy.deepcopy(full)
    model = split_model(HFDecoderSplitter(full), manager)
    optimizer = LowLevelZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        dp_process_group=mesh.get_group_along_axis("dp"),
        partition_grad=stage == 2,
    )
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(2):
        batch = _batch(step)
        optimizer.zero_grad()
        result = schedule.forward_backward_step(model, _forever(batch), _loss, optimizer, return_loss=True)
        optimizer.step()
        reference_optimizer.zero_grad()
        expected = torch.zeros(())
        for half in (slice(0, 2), slice(2, 4)):
            out = reference(**{k: v[half] for k, v in batch.items()})
            (out.loss / 2).backward()
            expected = expected + out.loss.detach() / 2
        reference_optimizer.step()
        if result["loss"] is not None:
            torch.testing.assert_close(result["loss"], expected, atol=1e-5, rtol=1e-5)
    trained = dict(reference.named_parameters())
    names = {id(p): n for n, p in full.named_parameters()}
    held = list(model.parameters())
    assert held, "each stage holds some of the model"
    for param in held:
        torch.testing.assert_close(param, trained[names[id(param)]], atol=1e-5, rtol=1e-4, msg=names[id(param)])
