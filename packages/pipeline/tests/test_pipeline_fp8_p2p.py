"""fp8_communication between pipeline stages (2 ranks, 1F1B, a bf16 ToyNet): once the probe has cached the
metadata, every floating activation and gradient travels as fp8 plus its 4-byte scale (exactly half of bf16's
payload bytes plus 4 per tensor; the headers unchanged), the next stage computes with exactly the dequantized
E4M3 values of what the previous one sent, and the step's loss stays within fp8's rounding of the plain one."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import ProcessGroupMesh
from cx_mesh.fp8 import E4M3, quantize
from cx_mesh.testing import count_collective_bytes, distributed
from cx_pipeline import OneForwardOneBackwardSchedule, PipelineStageManager, split_model
from pipeline_helpers import HIDDEN, ToyNet, batches, toy_batch, toy_criterion

MICRO, MB = 4, 2  # micro-batches per step, samples per micro-batch
HEADER_BYTES = 3 * 8  # one int64 header (status, metadata size, CRC) per activation message
LEAVES = 3  # hidden_states [MB, HIDDEN] and two aux [MB]: what stage 0 sends (and gets gradients for)
ELEMENTS = MB * HIDDEN + 2 * MB


def _step(rank: int, world_size: int, fp8: bool) -> tuple[float | None, int, Any]:
    """One probing step, then one counted step; returns the counted step's loss (last stage), the bytes batched
    through p2p, and the hidden state stage 0 sent / stage 1 received in the counted step's last micro-batch."""
    torch.manual_seed(0)
    net = ToyNet(4).to(torch.bfloat16)
    manager = PipelineStageManager(ProcessGroupMesh(world_size, axis_names=("pp",)), "pp")
    schedule = OneForwardOneBackwardSchedule(manager, num_microbatches=MICRO, fp8_communication=fp8)
    model = split_model(net, manager)
    seen: dict[str, torch.Tensor] = {}
    stage: nn.Module = model.chunks[0]

    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if rank == 0:
            seen["hidden"] = output["hidden_states"].detach().clone()
        else:
            seen["hidden"] = kwargs["hidden_states"].detach().clone()

    stage.register_forward_hook(hook, with_kwargs=True)
    batch = {k: v.to(torch.bfloat16) for k, v in toy_batch(MICRO * MB, tied=False, as_dict=True, seed=0).items()}
    schedule.forward_backward_step(model, batches(batch), toy_criterion)  # the probe fills the metadata cache
    with count_collective_bytes() as counted:
        result = schedule.forward_backward_step(model, batches(batch), toy_criterion, return_loss=True)
    loss = result.get("loss")
    return None if loss is None else float(loss), counted.by_op.get("batch_isend_irecv", 0), seen["hidden"]


@distributed(world_size=2)
def test_pipeline_fp8_p2p_halves_the_bytes_and_sends_the_quantized_values(rank: int, world_size: int) -> None:
    plain_loss, plain_bytes, _ = _step(rank, world_size, fp8=False)
    loss, sent, hidden = _step(rank, world_size, fp8=True)
    headers = MICRO * HEADER_BYTES
    transfers = 2 * MICRO * LEAVES  # this rank's side of every activation and gradient tensor of the step
    assert plain_bytes == headers + transfers // LEAVES * 2 * ELEMENTS, "the plain step moved other bytes than bf16's"
    assert sent - headers == (plain_bytes - headers) // 2 + 4 * transfers, (sent, plain_bytes)

    theirs = hidden.clone()  # stage 1 received exactly the E4M3 rounding of what stage 0 sent
    dist.broadcast(theirs, 0)
    if rank == 1:
        assert torch.equal(hidden, quantize(theirs, E4M3).dequantize(torch.bfloat16))
        assert loss is not None
        assert plain_loss is not None
        # E4M3 keeps 3 mantissa bits: each received activation is within 2^-4 of what was sent (half an ulp); the
        # loss, two residual blocks and a linear head away, is allowed twice that
        assert loss == pytest.approx(plain_loss, rel=2 * 2**-4)
