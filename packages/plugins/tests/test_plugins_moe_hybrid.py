"""MoeHybridParallelPlugin against single-process fp32 training of a tiny HF Mixtral with the aux loss on
(`output_router_logits=True`): ep 2 on two ranks (moe_dp 1) at zero_stage 0, 1 and 2, moe_dp 2 x ep 2 and
tp 2 x ep 2 on four, with and without clipping by the global norm, with frozen experts and with experts no token
reaches; fp16 and bf16 within their tolerances. Data-parallel semantics: each rank trains on its own rows, the
reference on the mean of the ranks' losses (each with its own aux loss). Losses every step and every parameter after
five steps (fp32: within 1e-4 relative), TP shards and expert slices gathered by name. Then each configuration the
plugin refuses."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import MoeHybridParallelPlugin
from cx_plugins._layout import LayoutError
from moe_hybrid_test_helpers import mixtral, rows, train_and_compare, unrouted

transformers = pytest.importorskip("transformers")

STEPS = 5


def unrouted_mixtral() -> nn.Module:
    """Top-1 routing to experts 0 or 1 only (frozen routers): ep rank 1's experts 2 and 3 never receive a token."""
    return unrouted(functools.partial(mixtral, top_k=1))()


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_plugins_moe_hybrid_ep2(rank: int, world_size: int, zero_stage: int) -> None:
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    assert (plugin.ep_size, plugin.moe_dp_size, plugin.dp_size) == (2, 1, 2)
    train_and_compare(plugin, steps=STEPS)  # checkpoints: test_plugins_moe_checkpoint.py


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_plugins_moe_hybrid_ep2_overlap(rank: int, world_size: int, zero_stage: int) -> None:
    """overlap_communication=True is kept with experts (ColossalAI turns it off and ZeRO-2 into ZeRO-1)."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage, overlap_communication=True
    )
    train_and_compare(plugin, model_fn=unrouted_mixtral, steps=STEPS)


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_plugins_moe_hybrid_ep2_clipped(rank: int, world_size: int, zero_stage: int) -> None:
    """The global norm counts each expert slice once and each dense gradient once (not once per ep rank)."""
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    train_and_compare(plugin, clip=0.05, steps=STEPS)


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_moe_hybrid_frozen_experts(rank: int, world_size: int, zero_stage: int) -> None:
    """No trainable expert parameter (ColossalAI #6237 raises here): the dense part trains, the experts stay."""
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    train_and_compare(plugin, freeze_experts=True, steps=STEPS)


@distributed(world_size=4)
@pytest.mark.parametrize(("zero_stage", "moe_dp_outside"), [(0, True), (2, False)])
def test_plugins_moe_hybrid_moe_dp2_ep2(rank: int, world_size: int, zero_stage: int, moe_dp_outside: bool) -> None:
    """moe_dp 2 x ep 2: expert slices averaged over moe_dp, dense parameters over all four data-parallel ranks."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage, moe_dp_outside=moe_dp_outside
    )
    assert (plugin.ep_size, plugin.moe_dp_size, plugin.dp_size) == (2, 2, 4)
    train_and_compare(plugin, clip=0.05 if zero_stage == 0 else 0.0, steps=STEPS)


@distributed(world_size=4)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_moe_hybrid_tp2_ep2(rank: int, world_size: int, zero_stage: int) -> None:
    """tp 2 x ep 2: attention split over tp (experts whole within each tp pair), experts over the ep pair."""
    plugin = MoeHybridParallelPlugin(tp_size=2, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    assert (plugin.tp_size, plugin.ep_size, plugin.dp_size) == (2, 2, 2)
    train_and_compare(plugin, clip=0.05, steps=STEPS)


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_plugins_moe_hybrid_unrouted_experts(rank: int, world_size: int, zero_stage: int) -> None:
    """Experts that no token reaches (ColossalAI downgrades ZeRO-2 to ZeRO-1 because they hang it): same result."""
    with torch.no_grad():
        logits = unrouted_mixtral()(input_ids=rows(0), labels=rows(0)).router_logits
    assert all(int(layer.argmax(-1).max()) <= 1 for layer in logits), "experts 2 and 3 must get no token"
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    train_and_compare(plugin, model_fn=unrouted_mixtral, steps=STEPS)


@distributed(world_size=2)
@pytest.mark.parametrize(("precision", "tol"), [("fp16", 5e-3), ("bf16", 3e-2)])
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_plugins_moe_hybrid_low_precision(
    rank: int, world_size: int, precision: str, tol: float, zero_stage: int
) -> None:
    """fp16 / bf16 with fp32 master weights against fp32 training on one process, within the precision's tolerance."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=2, precision=precision, zero_stage=zero_stage, initial_scale=2**8
    )
    train_and_compare(plugin, steps=3, tol=tol)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"enable_sequence_overlap": True}, "enable_sequence_overlap"),
        ({"fp8_communication": True}, "fp8"),
        ({"use_fp8": True}, "fp8"),
    ],
)
def test_plugins_moe_hybrid_refuses(kwargs: dict[str, Any], match: str) -> None:
    arguments: dict[str, Any] = {"tp_size": 1, "pp_size": 1, "ep_size": 1, **kwargs}
    with pytest.raises(NotImplementedError, match=match):
        MoeHybridParallelPlugin(**arguments)


@distributed(world_size=2)
def test_plugins_moe_hybrid_bad_sizes(rank: int, world_size: int) -> None:
    with pytest.raises(LayoutError, match=r"not divisible by ep_size = 3; ep_size can be 1 or 2"):
        MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=3)
    with pytest.raises(LayoutError, match=r"not divisible by ep\*tp = 2\*2 = 4"):
        MoeHybridParallelPlugin(tp_size=2, pp_size=1, ep_size=2)
    with pytest.raises(ValueError, match="ep_size must be a positive integer"):
        MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=0)
