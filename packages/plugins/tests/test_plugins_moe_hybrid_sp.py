"""MoeHybridParallelPlugin with sequence parallelism against single-process fp32 training of tiny HF Mixtral and
Qwen3-MoE models with the aux loss on: all_to_all and ring_attn on the sp axis (sp 2), split_gather / ring on the
tensor-parallel group (tp 2), and ep 2 x sp 2 all_to_all on 4 ranks (dense gradients averaged over ep x sp). Each
rank routes the tokens of its sequence shard; the aux loss still pools every token (router logits gathered over
the sequence-parallel group), so losses and parameters match one process. Reference semantics in
moe_test_helpers.py."""

from __future__ import annotations

from typing import Any

import pytest

from cx_mesh.testing import distributed
from cx_plugins import MoeHybridParallelPlugin
from moe_test_helpers import mixtral, qwen3_moe, train_and_compare

pytest.importorskip("transformers")


@distributed(world_size=2)
@pytest.mark.parametrize(
    ("model", "sizes", "zero_stage"),
    [
        ("mixtral", {"tp_size": 1, "sp_size": 2, "sequence_parallelism_mode": "all_to_all"}, 0),
        ("qwen3_moe", {"tp_size": 1, "sp_size": 2, "sequence_parallelism_mode": "ring_attn"}, 1),
        ("mixtral", {"tp_size": 2, "sequence_parallelism_mode": "split_gather"}, 1),
        ("qwen3_moe", {"tp_size": 2, "sequence_parallelism_mode": "ring"}, 0),
    ],
    ids=["all_to_all-mixtral", "ring_attn-qwen3_moe", "split_gather-mixtral", "ring-qwen3_moe"],
)
def test_plugins_moe_hybrid_sequence_parallel(
    rank: int, world_size: int, model: str, sizes: dict[str, Any], zero_stage: int
) -> None:
    plugin = MoeHybridParallelPlugin(
        pp_size=1, ep_size=1, precision="fp32", zero_stage=zero_stage, enable_sequence_parallelism=True, **sizes
    )
    train_and_compare(plugin, model_fn=mixtral if model == "mixtral" else qwen3_moe, clip=0.05)


@distributed(world_size=4)
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_plugins_moe_hybrid_ep2_sp2_all_to_all(rank: int, world_size: int, zero_stage: int) -> None:
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=2, sp_size=2, precision="fp32", zero_stage=zero_stage,
        enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all",
    )  # fmt: skip
    assert (plugin.ep_size, plugin.sp_size, plugin.dp_size) == (2, 2, 2)
    train_and_compare(plugin, clip=0.05)
