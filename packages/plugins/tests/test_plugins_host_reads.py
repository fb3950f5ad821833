"""Issue 37: a plain training loop that never reads the loss makes no host reads in cx code once warmed up.

Steps 4-6 of a tiny bf16 Llama (Mixtral for MoE) are counted with `count_host_reads` on two gloo ranks; TorchDDP is
the baseline (torch's own DDP, no cx checks). The checks that used to read every step now read on the first steps,
on change, or every `FINITE_LOSS_CHECK_EVERY` backward calls (docs/plugins.md, "Host reads"); the pipeline agrees on
probing on the first 3 steps only and checks settled activation headers on the device; ring_attn's plain causal mask
is known on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import count_host_reads, distributed
from cx_plugins import (
    Booster,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    MoeHybridParallelPlugin,
    Plugin,
    TorchDDPPlugin,
)
from hybrid_test_helpers import batch, llama
from moe_hybrid_test_helpers import mixtral, rows

WARM_STEPS, COUNTED_STEPS = 3, 3
# An uneven all-to-all needs its split sizes on the host: the MoE dispatch's one read per layer is the exemption.
MOE_EXEMPT = ("cx_moe._dispatch:",)

PLUGINS: dict[str, Callable[[], Plugin]] = {
    "torch_ddp": TorchDDPPlugin,
    "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="bf16"),
    "gemini": lambda: GeminiPlugin(precision="bf16", chunk_config_dict={"chunk_size": 4096}),
    "hybrid_tp2": lambda: HybridParallelPlugin(tp_size=2, pp_size=1, precision="bf16"),
    "hybrid_sp2_ring": lambda: HybridParallelPlugin(
        tp_size=1,
        pp_size=1,
        sp_size=2,
        precision="bf16",
        enable_sequence_parallelism=True,
        sequence_parallelism_mode="ring_attn",
    ),
    "hybrid_pp2": lambda: HybridParallelPlugin(tp_size=1, pp_size=2, precision="bf16", num_microbatches=2),
    "hybrid_pp2_interleaved": lambda: HybridParallelPlugin(
        tp_size=1,
        pp_size=2,
        precision="bf16",
        num_microbatches=2,
        pp_style="interleaved",
        num_model_chunks=2,
    ),
    "moe_ep2_zero1": lambda: MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, zero_stage=1, precision="bf16"),
}


def _step(booster: Booster, model: nn.Module, optimizer: Any, plugin: Plugin, step: int, moe: bool) -> None:
    inputs: dict[str, torch.Tensor] = {"input_ids": rows(step)} if moe else {"input_ids": batch(step)["input_ids"]}
    inputs["labels"] = inputs["input_ids"]
    if isinstance(plugin, HybridParallelPlugin) and plugin.pp_size > 1:
        booster.execute_pipeline(iter([inputs]), model, lambda out, _: out.loss, optimizer, return_loss=True)
    else:
        booster.backward(model(**inputs).loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()


@distributed(world_size=2)
@pytest.mark.parametrize(
    "name",
    list(PLUGINS),
)
def test_plugins_steady_state_makes_no_host_reads(rank: int, world_size: int, name: str) -> None:
    plugin = PLUGINS[name]()
    moe = name.startswith("moe")
    plain = mixtral() if moe else llama(layers=4 if name.endswith("interleaved") else 2)
    booster = Booster(plugin=plugin, mixed_precision="bf16" if name == "torch_ddp" else None)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3))
    with count_host_reads() as reads:
        for step in range(WARM_STEPS + COUNTED_STEPS):
            if step == WARM_STEPS:
                reads.clear()
            _step(booster, model, optimizer, plugin, step, moe)
        counted = reads.cx(exempt=MOE_EXEMPT if moe else ())
    if moe:  # the exemption is real: the dispatch does read its split sizes, and nothing else in cx does
        assert reads.cx().keys() - counted.keys(), "the MoE dispatch reads its split sizes on the host"
    assert counted == {}, f"{name}: host reads in steps {WARM_STEPS + 1}-{WARM_STEPS + COUNTED_STEPS}: {counted}"
