"""MoeHybridParallelPlugin with pipeline parallelism against single-process fp32 training of tiny HF Mixtral and
Qwen3-MoE models with the aux loss on: pp 2 alone (ep 1, 2 ranks), ep 2 x pp 2 and moe_dp 2 x pp 2 in both mesh
orders (4 ranks), tp 2 x pp 2 x ep 2 (8 ranks). The last stage's aux
loss pools the router logits of every layer of the micro-batch (earlier stages send theirs with the hidden states),
as transformers' does; experts that no token reaches do not hang the pipeline. Reference semantics in
moe_hybrid_test_helpers.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cx_mesh.testing import distributed
from cx_plugins import MoeHybridParallelPlugin
from cx_plugins._layout import Axis
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
@pytest.mark.parametrize(
    ("model", "zero_stage", "clip"), [("mixtral", 0, 0.05), ("mixtral", 2, 0.0), ("qwen3_moe", 1, 0.05)]
)
def test_plugins_moe_hybrid_ep2_pp2(rank: int, world_size: int, model: str, zero_stage: int, clip: float) -> None:
    """ep 2 x pp 2, five steps: each stage's experts split over its ep pair, dense parameters averaged over the pair
    (Qwen3-MoE with four layers, the second dense: both stages hold experts, stage 0 a dense MLP too)."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=2, ep_size=2, precision="fp32", zero_stage=zero_stage, num_microbatches=2
    )
    assert (plugin.pp_size, plugin.ep_size, plugin.moe_dp_size, plugin.dp_size) == (2, 2, 1, 2)
    model_fn = mixtral if model == "mixtral" else lambda: qwen3_moe(layers=4)
    train_and_compare(plugin, model_fn=model_fn, clip=clip, steps=5)


@distributed(world_size=4)
@pytest.mark.parametrize("moe_dp_outside", [True, False])
def test_plugins_moe_hybrid_moe_dp2_pp2(rank: int, world_size: int, moe_dp_outside: bool) -> None:
    """moe_dp 2 x pp 2: the mesh order decides who pairs with whom ((moe_dp, pp, ...): stages are neighbouring ranks;
    (pp, moe_dp, ...): they are two apart), and training matches one process either way."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=2, ep_size=1, precision="fp32", zero_stage=1, num_microbatches=2,
        moe_dp_outside=moe_dp_outside,
    )  # fmt: skip
    assert (plugin.pp_size, plugin.moe_dp_size, plugin.dp_size) == (2, 2, 2)
    expected = [[0, 1], [2, 3]] if moe_dp_outside else [[0, 2], [1, 3]]
    assert plugin.layout.ranks(Axis.PP) == next(pair for pair in expected if rank in pair)
    train_and_compare(plugin)


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


@distributed(world_size=8, timeout=300)
@pytest.mark.parametrize(("zero_stage", "clip"), [(0, 0.05), (1, 0.0)])
def test_plugins_moe_hybrid_tp2_pp2_ep2(rank: int, world_size: int, zero_stage: int, clip: float) -> None:
    """tp 2 x pp 2 x ep 2 on eight ranks, five steps: attention split over each tp pair, experts over each ep pair,
    the two stages exchanging tp-replicated hidden states and router logits. The mesh is (moe_dp 1, pp, ep, tp, sp 1),
    so rank = 4 pp + 2 ep + tp; dense parameters are averaged over the ep pair (dp = moe_dp x ep), expert slices over
    moe_dp (this rank alone)."""
    plugin = MoeHybridParallelPlugin(
        tp_size=2, pp_size=2, ep_size=2, precision="fp32", zero_stage=zero_stage, num_microbatches=2
    )
    assert (plugin.tp_size, plugin.pp_size, plugin.ep_size, plugin.moe_dp_size, plugin.dp_size) == (2, 2, 2, 1, 2)
    pp, ep, tp = rank // 4, rank // 2 % 2, rank % 2
    groups = {
        Axis.TP: [4 * pp + 2 * ep + t for t in range(2)],
        Axis.EP: [4 * pp + 2 * e + tp for e in range(2)],
        Axis.PP: [4 * p + 2 * ep + tp for p in range(2)],
        Axis.MOE_DP: [rank],
    }
    for axis, ranks in groups.items():
        assert plugin.layout.ranks(axis) == ranks, axis
    assert dist.get_process_group_ranks(plugin.tp_group) == groups[Axis.TP]
    assert dist.get_process_group_ranks(plugin.ep_group) == groups[Axis.EP]
    assert dist.get_process_group_ranks(plugin.pp_group) == groups[Axis.PP]
    assert dist.get_process_group_ranks(plugin.dp_group) == groups[Axis.EP]  # moe_dp x ep with moe_dp 1
    assert dist.get_process_group_ranks(plugin.moe_dp_group) == [rank]
    assert plugin.data_parallel_rank_and_size() == (ep, 2)  # the ep pair sees different rows, the tp pair the same
    train_and_compare(plugin, clip=clip, steps=5)
