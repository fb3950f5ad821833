"""MoeHybridParallelPlugin with pipeline parallelism against single-process fp32 training of tiny HF Mixtral and
Qwen3-MoE models with the aux loss on: pp 2 alone (ep 1, 2 ranks) and ep 2 x pp 2 (4 ranks). The last stage's aux
loss pools the router logits of every layer of the micro-batch (earlier stages send theirs with the hidden states),
as transformers' does; experts that no token reaches do not hang the pipeline. Reference semantics in
moe_hybrid_test_helpers.py."""

from __future__ import annotations

import pytest
import torch

from cx_mesh.testing import distributed
from cx_plugins import MoeHybridParallelPlugin
from moe_hybrid_test_helpers import mixtral, qwen3_moe, rows, train_and_compare, unrouted

pytest.importorskip("transformers")


@distributed(world_size=2)
@pytest.mark.parametrize(("model", "zero_stage"), [("mixtral", 0), ("qwen3_moe", 1)])
def test_plugins_moe_hybrid_pp2(rank: int, world_size: int, model: str, zero_stage: int) -> None:
    """pp 2 with ep 1: the stages exchange hidden states and router logits (forward) and their gradients."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=2, ep_size=1, precision="fp32", zero_stage=zero_stage, num_microbatches=2
    )
    assert (plugin.pp_size, plugin.ep_size, plugin.dp_size) == (2, 1, 1)
    train_and_compare(plugin, model_fn=mixtral if model == "mixtral" else qwen3_moe)


@distributed(world_size=2)
def test_plugins_moe_hybrid_pp2_zbv(rank: int, world_size: int) -> None:
    """The zero-bubble V schedule (backward split into input and weight gradients) with router logits between the
    four chunks of two stages."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=2, ep_size=1, precision="fp32", zero_stage=1, num_microbatches=2, pp_style="zbv",
        num_model_chunks=2,
    )  # fmt: skip
    train_and_compare(plugin, model_fn=lambda: mixtral(layers=4))


@distributed(world_size=4)
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_plugins_moe_hybrid_ep2_pp2(rank: int, world_size: int, zero_stage: int) -> None:
    """ep 2 x pp 2: each stage's experts split over its ep pair, dense parameters averaged over the pair."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=2, ep_size=2, precision="fp32", zero_stage=zero_stage, num_microbatches=2
    )
    assert (plugin.pp_size, plugin.ep_size, plugin.moe_dp_size, plugin.dp_size) == (2, 2, 1, 2)
    train_and_compare(plugin, clip=0.05 if zero_stage == 0 else 0.0)


@distributed(world_size=4)
def test_plugins_moe_hybrid_ep2_pp2_unrouted(rank: int, world_size: int) -> None:
    """Experts 2 and 3 (ep rank 1's) get no token in any micro-batch: no hang, same result."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=2, ep_size=2, precision="fp32", zero_stage=1, num_microbatches=2, pp_style="interleaved",
        num_model_chunks=2,
    )  # fmt: skip
    build = unrouted(lambda: mixtral(layers=4, top_k=1))
    with torch.no_grad():
        logits = build()(input_ids=rows(0), labels=rows(0)).router_logits
    assert len(logits) == 4
    assert all(int(layer.argmax(-1).max()) <= 1 for layer in logits), "experts 2 and 3 must get no token"
    train_and_compare(plugin, model_fn=build)


@distributed(world_size=2)
def test_plugins_moe_hybrid_pp_bad_sizes(rank: int, world_size: int) -> None:
    """Sizes that do not fit the world name the ones that would (on every rank, before any group is built)."""
    from cx_plugins._layout import LayoutError

    with pytest.raises(LayoutError, match=r"not divisible by pp\*ep = 2\*2 = 4; pp_size can be 1 \(with ep_size=2\)"):
        MoeHybridParallelPlugin(tp_size=1, pp_size=2, ep_size=2, num_microbatches=2)
    with pytest.raises(LayoutError, match=r"not divisible by pp_size = 3; pp_size can be 1 or 2"):
        MoeHybridParallelPlugin(tp_size=1, pp_size=3, ep_size=1, num_microbatches=2)
    with pytest.raises(ValueError, match="needs num_microbatches or microbatch_size"):
        MoeHybridParallelPlugin(tp_size=1, pp_size=2, ep_size=1)
