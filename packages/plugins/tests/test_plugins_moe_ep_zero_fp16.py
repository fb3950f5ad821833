"""ColossalAI's test_moe_ep_zero in cx's terms: MoeHybridParallelPlugin with ep 2 and ZeRO (stage 1 and 2) in fp16
(and bf16) on a tiny `MixtralModel` fed fp32 `inputs_embeds`, against fp32 training on one process.

The ported test failed in cx with "expected m1 and m2 to have the same dtype, but got: float != c10::Half": the
boosted model did not cast floating-point inputs to the training precision, as ColossalAI's HybridParallelModule
does. Tolerances are the precision tests' (test_plugins_hybrid_precision.py, test_plugins_moe_hybrid.py): fp16 keeps
11 significant bits (unit roundoff 2**-11 ~ 4.9e-4), bf16 8 (2**-8 ~ 3.9e-3); a few layers of accumulated rounding
in the forward and backward put results within about ten units of the fp32 ones, 5e-3 and 3e-2 relative."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import Booster, HybridParallelModule, MoeHybridParallelPlugin
from moe_hybrid_test_helpers import LENGTH, LR, ROWS, compare_parameters

transformers = pytest.importorskip("transformers")

HIDDEN, STEPS = 16, 3
TOLERANCE = {"fp16": 5e-3, "bf16": 3e-2}


def _mixtral_model() -> nn.Module:
    """ColossalAI's test model: a bare MixtralModel (no LM head), 4 experts, top-1 routing."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_local_experts=4, num_experts_per_tok=1, vocab_size=50, max_position_embeddings=32,
        router_jitter_noise=0.0, use_cache=False,
    )  # fmt: skip
    model: nn.Module = transformers.MixtralModel(config)
    return model


def _embeds(step: int) -> torch.Tensor:
    return torch.rand(ROWS, LENGTH, HIDDEN, generator=torch.Generator().manual_seed(200 + step))  # fp32, as given


def _loss(hidden: torch.Tensor) -> torch.Tensor:
    return hidden.float().pow(2).mean()


@distributed(world_size=2)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_moe_ep2_zero_low_precision_takes_fp32_inputs(
    rank: int, world_size: int, precision: str, zero_stage: int
) -> None:
    tol = TOLERANCE[precision]
    model = _mixtral_model()
    reference = copy.deepcopy(model)
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=2, zero_stage=zero_stage, precision=precision, initial_scale=2**8,
        overlap_communication=False,
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    dtype = plugin.options.precision.dtype
    ids, floats = torch.ones(2, dtype=torch.long), torch.ones(2)
    cast = boosted.cast_inputs({"ids": ids, "nested": [floats, (floats.double(), "text")]})  # what execute_pipeline
    assert cast["ids"] is ids  # feeds the stages too: floating tensors in the training precision, the rest as given
    assert [cast["nested"][0].dtype, cast["nested"][1][0].dtype, cast["nested"][1][1]] == [dtype, dtype, "text"]
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    share = ROWS // world_size  # ep 2 x moe_dp 1: dp 2, each rank its own rows
    for step in range(STEPS):
        embeds = _embeds(step)
        hidden = boosted(inputs_embeds=embeds[rank * share : (rank + 1) * share]).last_hidden_state
        assert hidden.dtype == dtype  # the fp32 input was cast, not rejected
        loss = _loss(hidden)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        ref_losses = [
            _loss(reference(inputs_embeds=embeds[r * share : (r + 1) * share]).last_hidden_state) for r in range(2)
        ]
        torch.stack(ref_losses).mean().backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        torch.testing.assert_close(float(loss), float(ref_losses[rank]), rtol=tol, atol=tol / 10)
    compare_parameters(boosted, reference, plugin, tol)
