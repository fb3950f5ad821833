"""enable_sequence_overlap through the plugins at 2 ranks: a tiny HF Llama trained a few steps under
HybridParallelPlugin (tp 2, split_gather) with the switch and without it, losses and parameters compared.

Tolerance from the arithmetic: the ring computes every element as the same dot product as the plain all-gather /
reduce-scatter path and adds the two ranks' partial sums in either order alike, so the runs can differ only where a
GEMM kernel's summation order changes with the sequence chunk's row count: at most `sum_tolerance` of a gradient
element's terms per step (`tiny_model_sgd_tolerance`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cx_mesh.testing import distributed, sum_tolerance
from cx_plugins import Booster, HybridParallelModule, HybridParallelPlugin
from cx_plugins._layout import Axis
from cx_shardformer import get_shard_spec, unshard_tensor
from hybrid_test_helpers import BATCH, LENGTH, LR, batch, llama

pytest.importorskip("transformers")

STEPS, MOMENTUM = 3, 0.9


def tiny_model_sgd_tolerance(steps: int, tokens: int) -> float:
    """Parameters' difference after `steps` SGD-with-momentum steps whose gradients differ by rounding only: each
    step moves by lr times the momentum sum of the gradient differences (1 + m + m^2 ...), the gradient elements of
    the tiny models summing 64 * tokens terms of absolute sum below 1e-2 (`tiny_model_adam_tolerance`); factor 2 for
    the feedback of a parameter difference into the next gradients."""
    grad = sum_tolerance(64 * tokens, 1e-2)
    moves = sum(sum(MOMENTUM**j for j in range(k + 1)) for k in range(steps))
    return 2 * LR * moves * grad


def _train(plugin: HybridParallelPlugin) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """Losses, full parameters after the steps, and how many layers ran the overlap ring."""
    model = llama(layers=2)
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    losses = []
    for step in range(STEPS):
        loss = boosted(**batch(step)).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    group = plugin.layout.group(Axis.TP)
    params = {}
    for name, param in boosted.unwrap().named_parameters():
        spec = get_shard_spec(param)
        params[name] = unshard_tensor(param.detach(), spec, group) if spec is not None else param.detach().clone()
    rings = sum(bool(getattr(m, "sequence_overlap", False)) for m in boosted.unwrap().modules())
    return losses, params, rings


def _named(what: str) -> Callable[[str], str]:
    return lambda message: f"{what}: {message}"


def _compare(got: Any, expected: Any, what: str) -> None:
    losses, params, _ = got
    ref_losses, ref_params, _ = expected
    tolerance = tiny_model_sgd_tolerance(STEPS, BATCH * LENGTH)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=tolerance)
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=0, atol=tolerance, msg=_named(f"{what} {name}"))


@distributed(world_size=2)
def test_plugins_hybrid_sequence_overlap_matches_plain(rank: int, world_size: int) -> None:
    sizes: dict[str, Any] = {"tp_size": 2, "pp_size": 1, "precision": "fp32", "enable_sequence_parallelism": True}
    plain = _train(HybridParallelPlugin(sequence_parallelism_mode="split_gather", **sizes))
    plugin = HybridParallelPlugin(sequence_parallelism_mode="split_gather", enable_sequence_overlap=True, **sizes)
    overlapped = _train(plugin)
    _compare(overlapped, plain, "enable_sequence_overlap")
    # every q/k/v/o, gate/up/down of the 2 layers runs in the ring; none without the switch
    assert (overlapped[2], plain[2]) == (2 * 7, 0)
