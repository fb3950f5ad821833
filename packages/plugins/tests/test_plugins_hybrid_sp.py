"""HybridParallelPlugin with sequence parallelism (fp32, HF Llama with grouped-query attention) against single-process
training: split_gather and ring on the tensor-parallel group, all_to_all (Ulysses) and ring_attn on the sp axis,
and all_to_all with tp 2 x sp 2 on 4 ranks (gradients averaged over dp x sp); every mode with pp 2 on 4 ranks."""

from __future__ import annotations

from typing import Any

import pytest

from cx_mesh.testing import distributed
from cx_plugins import HybridParallelPlugin
from hybrid_test_helpers import gpt2, llama, train_and_compare

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


INTERLEAVED: dict[str, Any] = {"pp_style": "interleaved", "num_model_chunks": 2}


@distributed(world_size=4)
@pytest.mark.parametrize(
    ("model", "sizes"),
    [
        ("llama", {"tp_size": 2, "sequence_parallelism_mode": "split_gather"}),
        ("llama", {"tp_size": 2, "sequence_parallelism_mode": "ring"}),
        ("llama", {"tp_size": 1, "sp_size": 2, "sequence_parallelism_mode": "all_to_all"}),
        ("llama", {"tp_size": 1, "sp_size": 2, "sequence_parallelism_mode": "ring_attn", **INTERLEAVED}),
        ("gpt2", {"tp_size": 1, "sp_size": 2, "sequence_parallelism_mode": "all_to_all"}),
    ],
    ids=["split_gather", "ring", "all_to_all", "ring_attn-interleaved", "all_to_all-gpt2"],
)
def test_plugins_hybrid_sequence_parallel_with_pipeline(
    rank: int, world_size: int, model: str, sizes: dict[str, Any]
) -> None:
    """pp 2 with each mode: stages pass sequence shards on; later stages rebuild the full-length rotary tables and
    mask (interleaved: stage 0's second chunk is a later stage too; GPT-2: its own stage module, tied embedding)."""
    plugin = HybridParallelPlugin(
        pp_size=2, num_microbatches=2, precision="fp32", enable_sequence_parallelism=True, **sizes
    )
    train_and_compare(plugin, model_fn=gpt2 if model == "gpt2" else llama)
