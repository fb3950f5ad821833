"""MoeHybridParallelPlugin at tp 2 (ep 1) with split_gather sequence parallelism, enable_sequence_overlap, use_fp8 and
fp8_communication: a tiny HF Mixtral (hidden 64, 4 query and 4 key/value heads, experts of 64, so every attention
projection's shard and every expert projection is fp8-eligible) trained 2 AdamW steps in bf16 against the same
switches without overlap. The attention blocks' gathers ring in fp8; the MoE blocks route their own sequence shard
(nothing to gather) through cx-moe's fp8 expert matmuls, in both runs.

Tolerance as test_plugins_overlap_fp8.py: the first step within AdamW's arithmetic (`assert_first_step_within_adam`,
2 lr plus rounding), the losses within rel 2u (u = 2^-4, E4M3), a budget for the two runs' different chunk scales and
wire roundings, not a derived bound. The router sees those differences too, so a token may pick another expert in one
run: the budget covers that only as far as the measured gap shows (9e-5 and 3.4e-4 relative over 2 steps). Skipped
without transformers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import count_collective_bytes, distributed
from cx_plugins import Booster, MoeHybridParallelPlugin
from fp8_test_helpers import assert_first_step_within_adam, fp8_linear_rows, parameters_now

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, EXPERTS, LAYERS, ROWS, LENGTH, STEPS, TOP_K, LR = 64, 64, 4, 2, 2, 16, 2, 2, 1e-3
U4 = 2.0**-4
Params = dict[str, torch.Tensor]


def _mixtral() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=LENGTH, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=False,
        use_cache=False, attention_dropout=0.0,
    )  # fmt: skip
    model: nn.Module = transformers.MixtralForCausalLM(config)
    return model


def _train(**switches: Any) -> tuple[list[float], Params, Params, int, int, int, int]:
    """Losses, parameters before and after the first step, how many layers were marked for the ring / fp8, the rows
    cx-moe's fp8 expert matmuls took, and the ring steps run (each an fp8 message; another dtype fails here)."""
    plugin = MoeHybridParallelPlugin(
        tp_size=2, pp_size=1, ep_size=1, precision="bf16", enable_sequence_parallelism=True,
        sequence_parallelism_mode="split_gather", use_fp8=True, fp8_communication=True, **switches,
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    model = _mixtral()
    boosted, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    assert optimizer is not None
    data = torch.randint(0, VOCAB, (STEPS, ROWS, LENGTH), generator=torch.Generator().manual_seed(7))
    losses, start = [], parameters_now(model)
    first: Params = {}
    with fp8_linear_rows() as rows, count_collective_bytes() as counted:
        for step in range(STEPS):
            loss = boosted(input_ids=data[step], labels=data[step]).loss
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            first = parameters_now(model) if step == 0 else first
            losses.append(float(loss.detach()))
    ring = {dtype: n for (op, dtype), n in counted.calls.items() if op == "batch_isend_irecv"}
    assert set(ring) <= {torch.uint8}, f"ring steps outside fp8: {ring}"
    modules = list(model.modules())
    rings = sum(bool(getattr(m, "sequence_overlap", False)) for m in modules)
    fp8 = sum(getattr(m, "fp8_recipe", None) is not None for m in modules)
    return losses, start, first, rings, fp8, sum(rows), ring.get(torch.uint8, 0)


@distributed(world_size=2, timeout=300)
def test_plugins_moe_hybrid_overlap_fp8_trains_like_plain_fp8(rank: int, world_size: int) -> None:
    plain, start, plain_first, plain_rings, plain_fp8, plain_rows, plain_steps = _train()
    got, _, first, rings, fp8, rows, steps = _train(enable_sequence_overlap=True)
    # tp 2, one step a ring: the attention block's column gather, its gradient sum, the row sum and its gradient
    # gather, per layer and step (the MoE blocks ring nothing)
    assert (steps, plain_steps) == (4 * LAYERS * STEPS, 0)
    # q, k, v, o of both layers: in fp8 either way, in the ring only with the switch (the experts are cx-moe's)
    assert (rings, plain_rings, fp8, plain_fp8) == (LAYERS * 4, 0, LAYERS * 4, LAYERS * 4)
    # exactly, whatever the routing: each of this rank's sequence-shard tokens goes through both fp8 matmuls (gate_up,
    # down) of its TOP_K experts once per layer and step (forward calls; backward reuses their saved operands)
    expected = STEPS * LAYERS * 2 * (ROWS * LENGTH // world_size) * TOP_K
    assert (rows, plain_rows) == (expected, expected)
    assert_first_step_within_adam(start, plain_first, first, LR)
    for step, (loss, reference) in enumerate(zip(got, plain, strict=True)):
        assert loss == pytest.approx(reference, rel=2 * U4), f"step {step}"
