"""Layers per stage balanced by cost (`num_layers_per_stage="balanced"` in the plugins): the split minimises the
costliest stage; the head counts at its matmul size, the embedding table at nothing."""

from __future__ import annotations

import itertools

import pytest
import torch

from cx_pipeline import HFDecoderSplitter, LayerCosts, PipelineConfigError, balanced_layers, layer_costs


def _costliest(counts: list[int], costs: LayerCosts) -> int:
    bounds = [0, *itertools.accumulate(counts)]
    n = len(costs.layers)
    return max(
        sum(costs.layers[a:b]) + (costs.first if a == 0 else 0) + (costs.last if b == n else 0)
        for a, b in itertools.pairwise(bounds)
    )


@pytest.mark.parametrize(
    ("layers", "first", "last", "slots"),
    [((4,) * 4, 0, 6, 2), ((1,) * 8, 0, 3, 4), ((3, 1, 4, 1, 5, 9, 2, 6), 2, 5, 3), ((2,) * 5, 0, 0, 5)],
)
def test_balanced_split_is_the_cheapest_costliest_stage(
    layers: tuple[int, ...], first: int, last: int, slots: int
) -> None:
    """Against every contiguous split with at least one layer per stage (exhaustive on these sizes)."""
    costs = LayerCosts(layers, first, last)
    counts = balanced_layers(costs, slots)
    assert sum(counts) == len(layers)
    assert len(counts) == slots
    assert min(counts) >= 1
    cuts = itertools.combinations(range(1, len(layers)), slots - 1)
    every = [[b - a for a, b in itertools.pairwise((0, *c, len(layers)))] for c in cuts]
    assert _costliest(counts, costs) == min(_costliest(c, costs) for c in every)


def test_balanced_split_without_extra_costs_is_even() -> None:
    assert balanced_layers(LayerCosts((5,) * 8, 0, 0), 4) == [2, 2, 2, 2]


def test_balanced_split_needs_a_layer_per_stage() -> None:
    with pytest.raises(PipelineConfigError, match="fewer than the 4 pipeline slots"):
        balanced_layers(LayerCosts((1, 1, 1), 0, 0), 4)


def test_a_sharded_lookup_table_counts_nothing() -> None:
    """A vocabulary-parallel embedding (ShardFormer's is no nn.Embedding subclass) is recognised by its
    `num_embeddings`, as torch's embedding is."""
    from torch import nn

    from cx_pipeline._balance import _matmul_parameters

    class ShardedLookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_embeddings = 100
            self.weight = nn.Parameter(torch.zeros(50, 8))

    stage = nn.Sequential(ShardedLookup(), nn.Linear(8, 8, bias=False))
    assert _matmul_parameters(stage) == 64


def test_hf_llama_costs_count_the_head_not_the_embedding() -> None:
    """A 4-layer Llama whose head outweighs a layer: the last stage gets one layer at pp 2 (even would give 2/2)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=4, use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    costs = layer_costs(HFDecoderSplitter(model))
    layer = model.model.layers[0]
    assert costs.layers == (sum(p.numel() for p in layer.parameters()),) * 4
    assert costs.first == 0  # the embedding is a lookup
    assert costs.last == 512 * 32 + 32  # head and final norm
    assert balanced_layers(costs, 2) == [3, 1]
