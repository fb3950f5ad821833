"""HybridParallelPlugin with use_fp8 and with fp8_communication: a tiny HF Llama (hidden 64, 2 layers, every projection
fp8-eligible) trained 30 steps in bf16 on 2 ranks at tp 2, at pp 2 and at dp 2 (zero_stage 0), each against the same
layout without fp8: the mean loss of the last 10 steps within the issue's 3%, and each switch really in fp8 where it
acts (the TP layers' fp8_linear and the plain Linears as Fp8Linear; fewer bytes, through the compressed collectives, on
the TP collectives, the pipeline p2p and the zero_stage-0 gradient all-reduce). At dp 2 the replicas stay bit-identical
(every rank dequantizes the same gathered fp8 values); at zero_stage 1 the switch reaches cx-zero's optimizer. Every
parameter after the first step within AdamW's bound of the bf16 run's (fp8_test_helpers; 97% of the elements moved in
the same direction as in the bf16 run with use_fp8, 97-99% with fp8_communication, measured; no floor asserted: none
follows from the arithmetic). Skipped without transformers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cx_mesh.fp8 import Fp8Linear
from cx_mesh.testing import CollectiveBytes, count_collective_bytes, distributed
from cx_plugins import Booster, HybridParallelPlugin
from cx_plugins.wrappers._zero import ZeroOptimizerWrapper
from fp8_test_helpers import assert_first_step_within_adam, assert_fp8_bytes, hybrid_fp8_llama, parameters_now

transformers = pytest.importorskip("transformers")

STEPS, VOCAB, ROWS, LENGTH, LR, LAST = 30, 128, 4, 16, 3e-3, 10
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tp_size": 2, "pp_size": 1},
    "pp2": {"tp_size": 1, "pp_size": 2, "num_microbatches": 2},
    "dp2": {"tp_size": 1, "pp_size": 1},
}


def _loss(outputs: Any, _micro_batch: Any) -> torch.Tensor:
    loss: torch.Tensor = outputs.loss
    return loss


Params = dict[str, torch.Tensor]


def _train(layout: str, **fp8: bool) -> tuple[list[float], nn.Module, CollectiveBytes, tuple[Params, Params]]:
    """Losses (on the rank holding them), the boosted model, the bytes handed to collectives in the whole run, and
    this rank's parameters before and after the first optimizer step."""
    arguments: dict[str, Any] = {**LAYOUTS[layout], **fp8}
    plugin = HybridParallelPlugin(precision="bf16", **arguments)
    booster = Booster(plugin=plugin)
    model = hybrid_fp8_llama(VOCAB, LENGTH)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    assert optimizer is not None
    dp_rank, dp_size = plugin.data_parallel_rank_and_size()
    data = torch.randint(0, VOCAB, (4, ROWS * dp_size, LENGTH), generator=torch.Generator().manual_seed(7))
    losses, start = [], parameters_now(model)
    first: Params = {}
    with count_collective_bytes() as counted:
        for step in range(STEPS):
            ids = data[step % 4][dp_rank * ROWS : (dp_rank + 1) * ROWS]
            mine = {"input_ids": ids, "labels": ids}
            if plugin.pp_size > 1:
                loss = booster.execute_pipeline(iter([mine]), boosted, _loss, optimizer, return_loss=True)["loss"]
            else:
                loss = boosted(**mine).loss
                booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            first = parameters_now(model) if step == 0 else first
            if loss is not None:
                losses.append(float(loss.detach()))
    return losses, model, counted, (start, first)


def _fp8_layers(model: nn.Module) -> list[str]:
    """Layers computing in fp8: the TP layers ShardConfig.use_fp8 switched on, and the Fp8Linear swaps."""
    return sorted(
        name
        for name, module in model.named_modules()
        if isinstance(module, Fp8Linear) or getattr(module, "fp8_recipe", None) is not None
    )


@distributed(world_size=2, timeout=300)  # three 30-step runs; a busy shared machine has taken 2 minutes
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_plugins_hybrid_fp8_switches_train_like_bf16(rank: int, world_size: int, layout: str) -> None:
    baseline, _, plain_bytes, (start, bf16_first) = _train(layout)
    if baseline:
        reference = sum(baseline[-LAST:]) / LAST
        assert reference < 0.8 * sum(baseline[:LAST]) / LAST, "the bf16 run must learn for the comparison to mean much"
    assert not _fp8_layers(hybrid_fp8_llama(VOCAB, LENGTH))

    losses, model, _, (_, fp8_first) = _train(layout, use_fp8=True)
    assert_first_step_within_adam(start, bf16_first, fp8_first, LR)
    converted = _fp8_layers(model)
    # q, k, v, o, gate, up and down of both layers (at pp 2 the other stage's layers are swapped too, and never run)
    assert len(converted) == 2 * 7, converted
    assert not any("lm_head" in name for name in converted)
    if baseline:
        assert sum(losses[-LAST:]) / LAST == pytest.approx(reference, rel=0.03), f"{layout} use_fp8"

    losses, model, fp8_bytes, (_, fp8_first) = _train(layout, fp8_communication=True)
    assert_first_step_within_adam(start, bf16_first, fp8_first, LR)
    assert not _fp8_layers(model)
    if baseline:
        assert sum(losses[-LAST:]) / LAST == pytest.approx(reference, rel=0.03), f"{layout} fp8_communication"
    if layout == "pp2":  # bf16 hidden states halve; each message adds a 24-byte header and 4 bytes a tensor
        ratio = fp8_bytes.by_op["batch_isend_irecv"] / plain_bytes.by_op["batch_isend_irecv"]
        assert 0.5 < ratio < 0.52, ratio
    else:
        # exact bytes (fp8_test_helpers): each bf16 all-reduce (TP activations and their gradients at tp 2, the
        # gradient buckets at dp 2) as an fp8 reduce-scatter then all-gather; the rest byte for byte as without the
        # switch: at tp 2 the vocab-parallel cross entropy's float32 reductions (row max, sum of exponentials, target
        # logit per token) and an int64 all-gather, at dp 2 the float32 gradient-presence flags (hybrid/_optimizer.py)
        assert_fp8_bytes(plain_bytes, fp8_bytes, world_size)
    if layout == "dp2":  # the replicas computed identical parameters from the fp8-averaged gradients
        for param in model.parameters():
            theirs = param.detach().clone()
            dist.broadcast(theirs, 0)
            assert torch.equal(param.detach(), theirs)


@distributed(world_size=2)
def test_plugins_hybrid_fp8_communication_reaches_zero(rank: int, world_size: int) -> None:
    plugin = HybridParallelPlugin(tp_size=1, pp_size=1, precision="bf16", zero_stage=1, fp8_communication=True)
    model = hybrid_fp8_llama(VOCAB, LENGTH)
    _, optimizer, *_ = Booster(plugin=plugin).boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    assert isinstance(optimizer, ZeroOptimizerWrapper)
    assert optimizer.zero.options.fp8_communication


# fp8_communication on one rank (a warning, not an error, as every plugin): test_plugins_fp8_one_rank.py
