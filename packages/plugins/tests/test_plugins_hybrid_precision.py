"""HybridParallelPlugin in fp16 and bf16 (fp32 master weights) against single-process fp32 training (tp 2, pp 2,
dp 2), with tolerances for the low precision, and fp16 loss scaling consistent across ranks: an overflow on one
pipeline stage skips the step on every rank and backs every rank's loss scale off alike."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from cx_mesh.testing import distributed
from cx_plugins import Booster, HybridParallelModule, HybridParallelPlugin
from cx_plugins.hybrid._optimizer import HybridParallelOptimizer, HybridZeroOptimizer
from hybrid_test_helpers import batch, llama, train_and_compare

pytest.importorskip("transformers")

TOLERANCE = {"fp16": 5e-3, "bf16": 3e-2}


@distributed(world_size=2)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize(
    "sizes",
    [{"tp_size": 2, "pp_size": 1}, {"tp_size": 1, "pp_size": 2, "num_microbatches": 2}, {"tp_size": 1, "pp_size": 1}],
    ids=["tp2", "pp2", "dp2"],
)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_hybrid_low_precision(
    rank: int, world_size: int, precision: str, sizes: dict[str, Any], zero_stage: int
) -> None:
    tol = TOLERANCE[precision]
    plugin = HybridParallelPlugin(precision=precision, zero_stage=zero_stage, initial_scale=2**8, **sizes)
    train_and_compare(plugin, steps=3, rtol=tol, atol=tol, loss_rtol=tol)


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_hybrid_fp16_overflow_skips_everywhere(rank: int, world_size: int, zero_stage: int) -> None:
    plugin = HybridParallelPlugin(
        tp_size=1, pp_size=2, precision="fp16", zero_stage=zero_stage, num_microbatches=2, initial_scale=2**8,
        hysteresis=1,
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    model = llama()
    boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert optimizer is not None
    assert isinstance(boosted, HybridParallelModule)
    held = [p for n, p in boosted.unwrap().named_parameters() if n in boosted.held_parameter_names()]
    before = [p.detach().clone() for p in held]
    if rank == 0:  # an inf reaches stage 0's gradients only
        hook = held[0].register_hook(lambda g: torch.full_like(g, math.inf))
    booster.execute_pipeline(iter([batch(0)]), boosted, lambda out, _: out.loss, optimizer)
    if rank == 0:
        hook.remove()
    optimizer.step()
    optimizer.zero_grad()
    assert isinstance(optimizer, HybridParallelOptimizer | HybridZeroOptimizer)
    assert optimizer.loss_scale == 2**7, "every rank backs off its loss scale"
    for old, param in zip(before, held, strict=True):
        torch.testing.assert_close(param.detach(), old, rtol=0, atol=0)  # the step was skipped on both stages
    booster.execute_pipeline(iter([batch(1)]), boosted, lambda out, _: out.loss, optimizer)
    optimizer.step()
    assert any(not torch.equal(p.detach(), old) for old, p in zip(before, held, strict=True)), "next step runs"
