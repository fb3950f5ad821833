"""GeminiDDP in bf16 / fp16 (with and without master weights) against an fp32-master PyTorch reference.

Tolerances: the reference computes each rank's gradient in the same low precision but averages it in fp32, while
Gemini reduces the low-precision gradient chunk (bf16: 8 mantissa bits, so ~0.4% per gradient element; fp16: ~0.05%).
With AdamW at lr 1e-3 a step moves each weight by at most ~lr, and a gradient differing in its last bits changes the
update by a similar relative amount, so after 5 steps master weights agree within a few 1e-4 absolute. The low
precision copies then round (bf16 weights ~1e-2 in magnitude: ulp ~ 6e-5). Losses agree to ~1% (bf16) / 0.2% (fp16).
"""

from __future__ import annotations

import pytest
import torch

from cx_mesh.testing import distributed
from cx_zero.gemini import GeminiDDP, GeminiOptimizer
from zero_gemini_helpers import Reference, assert_state_close, batch, lm_loss, local, make_gpt

STEPS = 5
TOLERANCE = {torch.bfloat16: (2e-2, 2e-3, 2e-2), torch.float16: (5e-3, 5e-4, 5e-3)}  # rtol, atol params; loss rtol


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@distributed(world_size=(1, 2, 4))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("master_weights", [True, False])
def test_zero_gemini_mixed_gpt_matches_reference(
    rank: int, world_size: int, dtype: torch.dtype, master_weights: bool
) -> None:
    rtol, atol, loss_rtol = TOLERANCE[dtype]
    if not master_weights:  # the optimizer steps on the low-precision shard itself: weights move by rounded steps
        atol = atol * 4
    # Adam's state in fp16 underflows (eps=1e-8 is 0 in fp16): without master weights fp16 trains with SGD+momentum
    make_optimizer = _sgd if (dtype == torch.float16 and not master_weights) else _adamw
    model = make_gpt()
    reference = Reference(make_gpt(), world_size, make_optimizer, dtype=dtype)
    ddp = GeminiDDP(model, chunk_config_dict={"chunk_size": 2048}, mixed_precision=dtype, master_weights=master_weights)
    optimizer = GeminiOptimizer(make_optimizer(list(ddp.parameters())), ddp, initial_scale=2**8)
    for step in range(STEPS):
        x, y = batch(step, world_size)
        optimizer.zero_grad()
        logits = ddp(local(x, rank, world_size))
        assert logits.dtype == dtype
        loss = lm_loss(logits, local(y, rank, world_size))
        optimizer.backward(loss)
        optimizer.step()
        reference.step(step)
        want = reference.losses[rank]
        assert abs(float(loss) - want) <= loss_rtol * abs(want), (float(loss), want)
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state(), rtol, atol, f"step {step}")
    if dtype == torch.float16:
        assert optimizer.loss_scale == 2**8  # no overflow in 5 clean steps; growth_interval is 1000


@distributed(world_size=2)
def test_zero_gemini_mixed_force_outputs_fp32(rank: int, world_size: int) -> None:
    ddp = GeminiDDP(make_gpt(), mixed_precision=torch.bfloat16, force_outputs_fp32=True)
    x, _ = batch(0, world_size)
    assert ddp(local(x, rank, world_size)).dtype == torch.float32
