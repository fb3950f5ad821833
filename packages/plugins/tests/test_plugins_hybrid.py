"""HybridParallelPlugin (fp32) against single-process training of an HF Llama with grouped-query attention: tp 2,
pp 2 (1F1B, interleaved, zero-bubble V), ZeRO-1 and ZeRO-2 at dp 2, and gradient clipping by the global norm.
Losses every step and parameters after five steps within 1e-4 relative (hybrid_test_helpers.py)."""

from __future__ import annotations

from typing import Any

import pytest

from cx_mesh.testing import distributed
from cx_plugins import HybridParallelPlugin
from hybrid_test_helpers import train_and_compare

pytest.importorskip("transformers")


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_hybrid_tp2(rank: int, world_size: int, zero_stage: int) -> None:
    train_and_compare(HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", zero_stage=zero_stage))


@distributed(world_size=2)
@pytest.mark.parametrize(
    "style",
    [
        {"pp_style": "1f1b"},
        {"pp_style": "interleaved", "num_model_chunks": 2},
        {"pp_style": "zbv", "num_model_chunks": 2},
    ],
    ids=["1f1b", "interleaved", "zbv"],
)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_hybrid_pp2(rank: int, world_size: int, style: dict[str, Any], zero_stage: int) -> None:
    plugin = HybridParallelPlugin(
        tp_size=1, pp_size=2, precision="fp32", zero_stage=zero_stage, num_microbatches=2, **style
    )
    train_and_compare(plugin)


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_plugins_hybrid_zero_dp2(rank: int, world_size: int, zero_stage: int) -> None:
    train_and_compare(HybridParallelPlugin(tp_size=1, pp_size=1, precision="fp32", zero_stage=zero_stage))


@distributed(world_size=4)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_hybrid_dp2_pp2(rank: int, world_size: int, zero_stage: int) -> None:
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp32", zero_stage=zero_stage, num_microbatches=2)
    train_and_compare(plugin)


@distributed(world_size=4)
def test_plugins_hybrid_tp2_pp2(rank: int, world_size: int) -> None:
    plugin = HybridParallelPlugin(tp_size=2, pp_size=2, precision="fp32", num_microbatches=2)
    train_and_compare(plugin)


@distributed(world_size=2)
@pytest.mark.parametrize(
    "layout", [{"tp_size": 2, "pp_size": 1}, {"tp_size": 1, "pp_size": 2, "num_microbatches": 2}], ids=["tp2", "pp2"]
)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_hybrid_clip_matches_single_process(
    rank: int, world_size: int, layout: dict[str, Any], zero_stage: int
) -> None:
    """clip_grad_by_norm returns and applies the single-process norm (tp-replicated and tied parameters once)."""
    train_and_compare(HybridParallelPlugin(precision="fp32", zero_stage=zero_stage, **layout), steps=3, clip=0.05)
