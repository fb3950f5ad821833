"""HybridParallelPlugin (fp32) against single-process training of an HF Llama with grouped-query attention: tp 2,
pp 2 (1F1B, interleaved, zero-bubble V), ZeRO-1 and ZeRO-2 at dp 2, and gradient clipping by the global norm.
Losses every step and parameters after five steps within 1e-4 relative (hybrid_test_helpers.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from cx_mesh.testing import distributed
from cx_plugins import Booster, HybridParallelModule, HybridParallelPlugin
from cx_plugins._layout import Axis
from hybrid_test_helpers import batch, compare_parameters, llama, train_and_compare

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
@pytest.mark.parametrize(
    ("layers", "style", "held_by_rank"),
    [
        (5, {"pp_style": "1f1b"}, ([0, 1, 2], [3, 4])),  # 3 / 2; even: 2 / 3
        (7, {"pp_style": "interleaved", "num_model_chunks": 2}, ([0, 1, 4, 5], [2, 3, 6])),  # 2/2/2/1; even: 1/2/2/2
    ],
    ids=["1f1b", "interleaved"],
)
def test_plugins_hybrid_pp2_balanced_layers(
    rank: int, world_size: int, layers: int, style: dict[str, Any], held_by_rank: tuple[list[int], list[int]]
) -> None:
    """num_layers_per_stage="balanced" splits a Llama by cost (the last virtual stage holds the head, so it gets no
    extra layer, unlike the even split) and trains as one process does."""
    model = llama(layers)
    plugin = HybridParallelPlugin(
        tp_size=1, pp_size=2, precision="fp32", num_microbatches=2, num_layers_per_stage="balanced", **style
    )
    train_and_compare(plugin, model_fn=lambda: model, steps=3)
    decoder_layers: Any = model.get_submodule("model.layers")
    held = [i for i, layer in enumerate(decoder_layers) if not next(layer.parameters()).is_meta]
    assert held == held_by_rank[rank]


@distributed(world_size=4)
def test_plugins_hybrid_tp2_pp2_balanced_layers(rank: int, world_size: int) -> None:
    """Under tensor parallelism the costs come from the sharded stages (the vocabulary-parallel embedding still
    counts as a lookup): the same 3 / 2 split as at tp 1, and training as one process does."""
    model = llama(5)
    plugin = HybridParallelPlugin(
        tp_size=2, pp_size=2, precision="fp32", num_microbatches=2, num_layers_per_stage="balanced"
    )
    train_and_compare(plugin, model_fn=lambda: model, steps=3)
    decoder_layers: Any = model.get_submodule("model.layers")
    held = [i for i, layer in enumerate(decoder_layers) if not next(layer.parameters()).is_meta]
    assert held == ([0, 1, 2] if plugin.layout.rank(Axis.PP) == 0 else [3, 4])


def test_plugins_hybrid_layers_per_stage_names_its_values() -> None:
    from cx_plugins.hybrid._options import parse_layers_per_stage

    assert parse_layers_per_stage("balanced", "P") == (None, True)
    assert parse_layers_per_stage([1, 3], "P") == ((1, 3), False)
    with pytest.raises(ValueError, match=r"num_layers_per_stage takes a list of layer counts, None .* or 'balanced'"):
        parse_layers_per_stage("even", "HybridParallelPlugin")


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_plugins_hybrid_zero_dp2(rank: int, world_size: int, zero_stage: int) -> None:
    train_and_compare(HybridParallelPlugin(tp_size=1, pp_size=1, precision="fp32", zero_stage=zero_stage))


@distributed(world_size=4)
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_plugins_hybrid_dp2_pp2(rank: int, world_size: int, zero_stage: int) -> None:
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp32", zero_stage=zero_stage, num_microbatches=2)
    train_and_compare(plugin)


@distributed(world_size=4)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_hybrid_tp2_pp2(rank: int, world_size: int, zero_stage: int) -> None:
    plugin = HybridParallelPlugin(tp_size=2, pp_size=2, precision="fp32", num_microbatches=2, zero_stage=zero_stage)
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


@distributed(world_size=2)
@pytest.mark.parametrize(
    "variant",
    [
        {"tp_size": 2, "pp_size": 1, "parallel_output": False},
        {"tp_size": 2, "pp_size": 1, "enable_all_optimization": True},
        {"tp_size": 2, "pp_size": 1, "gradient_checkpoint_config": "half"},
        {"tp_size": 2, "pp_size": 1, "custom_policy": "llama"},
        {"tp_size": 1, "pp_size": 2, "microbatch_size": 2, "num_layers_per_stage": [1, 3]},
        {"tp_size": 1, "pp_size": 2, "num_microbatches": 4, "enable_metadata_cache": False},
        {"tp_size": 1, "pp_size": 2, "num_microbatches": 4, "overlap_p2p": False},
    ],
    ids=[
        "gathered_output",
        "all_optimization",
        "checkpointing",
        "custom_policy",
        "microbatch_size",
        "no_cache",
        "no_p2p_overlap",
    ],
)
def test_plugins_hybrid_variants(rank: int, world_size: int, variant: dict[str, Any]) -> None:
    """ShardFormer switches and pipeline options pass through and keep training equal to one process."""
    from cx_shardformer import GradientCheckpointConfig
    from cx_shardformer.policies import LlamaForCausalLMPolicy

    options = dict(variant)
    if options.get("gradient_checkpoint_config") == "half":
        options["gradient_checkpoint_config"] = GradientCheckpointConfig(gradient_checkpointing_ratio=0.5)
    if options.get("custom_policy") == "llama":
        options["custom_policy"] = LlamaForCausalLMPolicy()
    train_and_compare(HybridParallelPlugin(precision="fp32", **options), steps=3)


@distributed(world_size=4)
def test_plugins_hybrid_pp_outside_dp(rank: int, world_size: int) -> None:
    """dp_outside=False puts pp outermost: stage ranks {0, 1} / {2, 3}, dp groups {0, 1} and {2, 3}."""
    plugin = HybridParallelPlugin(
        tp_size=1, pp_size=2, precision="fp32", num_microbatches=2, dp_outside=False, zero_stage=1
    )
    assert plugin.layout.ranks(Axis.DP) == ([0, 1] if rank < 2 else [2, 3])
    train_and_compare(plugin, steps=3)


@distributed(world_size=4)
def test_plugins_hybrid_dataloader_shards_by_dp_only(rank: int, world_size: int) -> None:
    """tp ranks of one replica read the same samples; the two dp replicas read disjoint halves."""
    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32")
    loader = plugin.prepare_dataloader(TensorDataset(torch.arange(16)), batch_size=4, shuffle=True, seed=3)
    mine = torch.cat([b[0] for b in loader])
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    tp_peer = rank ^ 1  # (dp, pp, tp) layout: ranks 2k and 2k+1 differ only in tp
    assert torch.equal(gathered[tp_peer], mine)
    other_replica = gathered[(rank + 2) % 4]
    assert not set(mine.tolist()) & set(other_replica.tolist())
    assert sorted(mine.tolist() + other_replica.tolist()) == list(range(16))


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 1])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_plugins_hybrid_optimizer_state_by_name(rank: int, world_size: int, zero_stage: int, precision: str) -> None:
    """state_dict_by_name (keyed by the model's own names, this stage's parameters, fp32 masters in mixed precision)
    loaded into a fresh boosted copy continues exactly like the original."""
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, precision=precision, zero_stage=zero_stage, num_microbatches=2)
    booster = Booster(plugin=plugin)

    def boosted() -> tuple[Any, Any]:
        net = llama()
        model, optimizer, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        return model, optimizer

    def step(model: Any, optimizer: Any, index: int) -> None:
        booster.execute_pipeline(iter([batch(index)]), model, lambda out, _: out.loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = boosted()
    step(model, optimizer, 0)
    state = optimizer.state_dict_by_name()
    held = model.held_parameter_names()
    assert set(state["state"]) == held
    assert all("exp_avg" in entry for entry in state["state"].values())
    assert ("master_weight" in next(iter(state["state"].values()))) == (precision == "bf16")
    copy_model, copy_optimizer = boosted()
    with torch.no_grad():
        source = dict(model.unwrap().named_parameters())
        for name, param in copy_model.unwrap().named_parameters():
            if name in held:
                param.copy_(source[name])
    copy_optimizer.update_master_params(copy_model)  # ColossalAI's call after loading weights into the model
    copy_optimizer.load_state_dict_by_name(state)
    step(model, optimizer, 1)
    step(copy_model, copy_optimizer, 1)
    source = dict(model.unwrap().named_parameters())
    for name, param in copy_model.unwrap().named_parameters():
        if name in held:
            torch.testing.assert_close(param, source[name], rtol=0, atol=0, msg=name)


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_hybrid_no_sync_accumulation(rank: int, world_size: int, zero_stage: int) -> None:
    """dp 2, two accumulation micro-steps per step (the first under booster.no_sync) equal one process on the batch."""
    plugin = HybridParallelPlugin(tp_size=1, pp_size=1, precision="fp32", zero_stage=zero_stage)
    booster = Booster(plugin=plugin)
    net = llama(2)
    reference = copy.deepcopy(net)
    model, optimizer, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert optimizer is not None
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        full = batch(step)
        mine = {k: v[rank * 4 : (rank + 1) * 4] for k, v in full.items()}
        halves = [{k: v[:2] for k, v in mine.items()}, {k: v[2:] for k, v in mine.items()}]
        with booster.no_sync(model, optimizer):
            booster.backward(model(**halves[0]).loss / 2, optimizer)
        booster.backward(model(**halves[1]).loss / 2, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        reference(**full).loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    assert isinstance(model, HybridParallelModule)
    compare_parameters(model, reference, plugin, rtol=1e-4, atol=1e-5)


@distributed(world_size=2)
def test_plugins_hybrid_pipeline_outputs(rank: int, world_size: int) -> None:
    """return_outputs gives the last stage's model outputs merged over micro-batches (None on other stages)."""
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp32", num_microbatches=2)
    booster = Booster(plugin=plugin)
    net = llama(2)
    reference = copy.deepcopy(net)
    model, optimizer, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1))
    data = batch(0)
    result = booster.execute_pipeline(iter([data]), model, lambda out, _: out.loss, optimizer, return_outputs=True)
    if rank == 1:
        torch.testing.assert_close(result["outputs"].logits, reference(**data).logits, rtol=1e-5, atol=1e-5)
        assert result["loss"] is not None
    else:
        assert result["outputs"] is None
        assert result["loss"] is None


def _reference_gpt_run(plugin: HybridParallelPlugin) -> None:
    from cx_plugins.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=64, max_positions=8, hidden_size=32, num_layers=4, num_heads=4)
    booster = Booster(plugin=plugin)
    net, reference = GPT(config, seed=0), GPT(config, seed=0)
    model, optimizer, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert optimizer is not None
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    dp_rank, dp_size = plugin.data_parallel_rank_and_size()
    for step in range(3):
        ids = batch(step)["input_ids"]
        share = ids.shape[0] // dp_size
        mine = ids[dp_rank * share : (dp_rank + 1) * share]
        if plugin.pp_size > 1:
            data = {"input_ids": mine, "labels": mine}
            booster.execute_pipeline(iter([data]), model, lambda loss, _: loss, optimizer)
        else:
            booster.backward(model(mine, labels=mine), optimizer)
        optimizer.step()
        optimizer.zero_grad()
        reference(ids, labels=ids).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    assert isinstance(model, HybridParallelModule)
    compare_parameters(model, reference, plugin, rtol=1e-4, atol=1e-5)


@distributed(world_size=2)
@pytest.mark.parametrize(
    "sizes",
    [{"tp_size": 1, "pp_size": 1}, {"tp_size": 2, "pp_size": 1}, {"tp_size": 1, "pp_size": 2, "num_microbatches": 2}],
    ids=["dp2", "tp2", "pp2"],
)
def test_plugins_hybrid_reference_gpt(rank: int, world_size: int, sizes: dict[str, Any]) -> None:
    """cx's own reference GPT (not a transformers model, tied embedding): dp 2 without ShardFormer, tp 2 with its
    registered policy, pp 2 through its PipelineSplittable methods."""
    _reference_gpt_run(HybridParallelPlugin(precision="fp32", **sizes))


@distributed(world_size=4)
def test_plugins_hybrid_reference_gpt_tp2_pp2(rank: int, world_size: int) -> None:
    _reference_gpt_run(HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2, precision="fp32", zero_stage=1))
