"""HybridParallelPlugin on HF GPT-2, whose input embedding and LM head are one tied parameter (fp32): at tp 2 (tied
weight sharded once, vocabulary-parallel) and at pp 2 (the tie spans the first and last stages: its gradient is summed
over them, both copies get the same update, and the global norm counts it once; under the zero-bubble V both ends are
on stage 0, one parameter) against single-process training."""

from __future__ import annotations

from typing import Any

import pytest

from cx_mesh.testing import distributed
from cx_plugins import HybridParallelPlugin
from hybrid_test_helpers import gpt2, train_and_compare

pytest.importorskip("transformers")


@distributed(world_size=2)
@pytest.mark.parametrize(
    "sizes",
    [
        {"tp_size": 2, "pp_size": 1},
        {"tp_size": 1, "pp_size": 2, "num_microbatches": 2},
        {"tp_size": 1, "pp_size": 2, "num_microbatches": 2, "pp_style": "zbv", "num_model_chunks": 2},
    ],
    ids=["tp2", "pp2", "pp2_zbv"],
)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_hybrid_gpt2_tied(rank: int, world_size: int, sizes: dict[str, Any], zero_stage: int) -> None:
    plugin = HybridParallelPlugin(precision="fp32", zero_stage=zero_stage, **sizes)
    train_and_compare(plugin, model_fn=gpt2, clip=0.05)
