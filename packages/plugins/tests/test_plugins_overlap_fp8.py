"""HybridParallelPlugin at tp 2 with split_gather sequence parallelism, enable_sequence_overlap, use_fp8 and
fp8_communication: a tiny HF Llama (hidden 64, every projection's shard fp8-eligible) trained a few AdamW
steps in bf16 against the same switches without overlap.

Tolerance. The first AdamW step is bounded by its arithmetic (`assert_first_step_within_adam`): from equal weights
the two runs' parameters differ by less than 2 lr plus rounding, whatever their fp8 gradients are. The losses are
compared at rel 2u, u = 2^-4 E4M3's unit roundoff: the two runs quantize the same operands with other scales
(TENSORWISE: per sequence chunk in the ring, per full sequence without) and round different partial sums on the fp8
wire, each at most u relative of its operand (E5M2's 2^-3 for gradients), one such rounding on each side. That is
a budget, not a bound: a forward error bound through two decoder layers (RMSNorm, softmax, SiLU) would need their
Lipschitz constants, which this test does not derive. Measured: 5e-6 to 6e-4 relative (over 3 steps, with and without
fp8_communication),
against 0.125 allowed; a ring that lost fp8 would still pass it, which the layer tests
(cx-shardformer's test_shardformer_overlap_fp8.py) rule out with their exact weight gradients. Skipped
without transformers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cx_mesh.testing import distributed
from cx_plugins import Booster, HybridParallelPlugin
from fp8_test_helpers import assert_first_step_within_adam, hybrid_fp8_llama, parameters_now

transformers = pytest.importorskip("transformers")

STEPS, VOCAB, ROWS, LENGTH, LR = 2, 128, 2, 16, 1e-3
U4 = 2.0**-4


def _train(**switches: Any) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor], int, int]:
    """Losses, parameters before and after the first step, and how many layers ran the ring / computed in fp8."""
    plugin = HybridParallelPlugin(
        tp_size=2, pp_size=1, precision="bf16", enable_sequence_parallelism=True,
        sequence_parallelism_mode="split_gather", use_fp8=True, **switches,
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    model = hybrid_fp8_llama(VOCAB, LENGTH)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    assert optimizer is not None
    data = torch.randint(0, VOCAB, (STEPS, ROWS, LENGTH), generator=torch.Generator().manual_seed(7))
    losses, start = [], parameters_now(model)
    first: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        loss = boosted(input_ids=data[step], labels=data[step]).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        first = parameters_now(model) if step == 0 else first
        losses.append(float(loss.detach()))
    modules = list(model.modules())
    rings = sum(bool(getattr(m, "sequence_overlap", False)) for m in modules)
    fp8 = sum(getattr(m, "fp8_recipe", None) is not None for m in modules)
    return losses, start, first, rings, fp8


@distributed(world_size=2, timeout=300)
def test_plugins_hybrid_overlap_fp8_trains_like_plain_fp8(rank: int, world_size: int) -> None:
    """use_fp8 with fp8_communication, both of what the ring now does in fp8 (each alone: the layer tests)."""
    plain, start, plain_first, plain_rings, plain_fp8 = _train(fp8_communication=True)
    got, _, first, rings, fp8 = _train(fp8_communication=True, enable_sequence_overlap=True)
    # q, k, v, o, gate, up, down of both layers: in fp8 either way, in the ring only with the switch
    assert (rings, plain_rings, fp8, plain_fp8) == (2 * 7, 0, 2 * 7, 2 * 7)
    assert_first_step_within_adam(start, plain_first, first, LR)
    for step, (loss, reference) in enumerate(zip(got, plain, strict=True)):
        assert loss == pytest.approx(reference, rel=2 * U4), f"step {step}"
