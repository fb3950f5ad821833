"""HybridParallelPlugin with sequence parallelism (fp32, HF Llama with grouped-query attention) against single-process
training: split_gather and ring on the tensor-parallel group, all_to_all (Ulysses) and ring_attn on the sp axis,
and all_to_all with tp 2 x sp 2 on 4 ranks (gradients averaged over dp x sp)."""

from __future__ import annotations

from typing import Any

import pytest

from cx_mesh.testing import distributed
from cx_plugins import HybridParallelPlugin
from hybrid_test_helpers import train_and_compare

pytest.importorskip("transformers")


@distributed(world_size=2)
@pytest.mark.parametrize(
    "sizes",
    [
        {"tp_size": 2, "sequence_parallelism_mode": "split_gather"},
        {"tp_size": 2, "sequence_parallelism_mode": "ring"},
        {"tp_size": 1, "sp_size": 2, "sequence_parallelism_mode": "all_to_all"},
        {"tp_size": 1, "sp_size": 2, "sequence_parallelism_mode": "ring_attn"},
    ],
    ids=["split_gather", "ring", "all_to_all", "ring_attn"],
)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_hybrid_sequence_parallel(rank: int, world_size: int, sizes: dict[str, Any], zero_stage: int) -> None:
    plugin = HybridParallelPlugin(
        pp_size=1, precision="fp32", zero_stage=zero_stage, enable_sequence_parallelism=True, **sizes
    )
    train_and_compare(plugin)


@distributed(world_size=4)
def test_plugins_hybrid_tp2_sp2_all_to_all(rank: int, world_size: int) -> None:
    plugin = HybridParallelPlugin(
        tp_size=2, pp_size=1, sp_size=2, precision="fp32", enable_sequence_parallelism=True,
        sequence_parallelism_mode="all_to_all",
    )  # fmt: skip
    assert plugin.dp_size == 1
    assert plugin.sp_size == 2
    train_and_compare(plugin)
