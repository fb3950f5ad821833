"""Layers per stage balanced by compute cost instead of by count.

An even split by layer count leaves the last stage with the final norm, the head and the loss besides its layers;
with a large vocabulary the head alone costs more than a layer, so the last stage sets the pipeline's pace while the
first idles (measured on a 4-layer Llama with a 4k vocabulary at pp 2: the last stage computes 1.55x the first).
Megatron-LM offers counting the embedding and the loss as whole layers; here each stage's cost is the number of
matmul parameters it holds (the FLOPs of a token through it are twice that), so the head counts at its size and the
embedding lookup, which does no matmul, counts nothing. The split is the contiguous one whose costliest stage is
cheapest (every stage keeps at least one layer); with several chunks per rank (interleaved, zero-bubble V) that is
each virtual stage, a proxy for the rank's sum that can miss the best per-rank split by a fraction of a layer.
Counts are of the parameters each rank holds: under tensor parallelism layers and head shrink alike; expert layers
count the experts the rank holds (E / ep) while its tokens run through top_k / ep of them on average, so an expert
block weighs E / top_k times its compute against dense layers and the head (a model of MoE layers only is split
nearly evenly; one mixing dense and MoE layers is mis-weighted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from cx_pipeline._errors import PipelineConfigError

if TYPE_CHECKING:
    from cx_pipeline._splitting import PipelineSplittable

__all__ = ["LayerCosts", "balanced_layers", "layer_costs"]


@dataclass(frozen=True)
class LayerCosts:
    """Matmul parameters of each layer, and what the first (input side) and last (output side) stages add."""

    layers: tuple[int, ...]
    first: int
    last: int


def _is_embedding(module: nn.Module) -> bool:
    """A lookup table: torch's, or a sharded one (ShardFormer's vocabulary-parallel embedding is no nn.Embedding
    subclass but carries `num_embeddings` as torch's does)."""
    return isinstance(module, nn.Embedding) or hasattr(module, "num_embeddings")


def _matmul_parameters(module: nn.Module) -> int:
    """Parameters of `module` outside embedding tables, each counted once (a tied head counts as the head)."""
    seen: set[int] = set()
    total = 0
    for sub in module.modules():
        if _is_embedding(sub):
            continue
        for param in sub.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel()
    return total


def layer_costs(model: PipelineSplittable) -> LayerCosts:
    """Each layer's cost from a one-layer stage of `model`, the input and output sides' from the difference a first
    and a last stage of that layer make."""
    count = model.pipeline_num_layers()
    if count < 1:
        raise PipelineConfigError("the model has no layers to split into pipeline stages")
    layers = tuple(_matmul_parameters(model.pipeline_stage_module(i, i + 1, False, False)) for i in range(count))
    first = _matmul_parameters(model.pipeline_stage_module(0, 1, True, False)) - layers[0]
    last = _matmul_parameters(model.pipeline_stage_module(count - 1, count, False, True)) - layers[-1]
    return LayerCosts(layers, max(0, first), max(0, last))


def balanced_layers(costs: LayerCosts, slots: int) -> list[int]:
    """Layer counts of `slots` contiguous stages minimising the costliest stage's cost (ties: the earliest cut)."""
    n = len(costs.layers)
    if n < slots:
        raise PipelineConfigError(f"the model has {n} layers, fewer than the {slots} pipeline slots")
    prefix = [0]
    for cost in costs.layers:
        prefix.append(prefix[-1] + cost)

    def stage_cost(start: int, end: int) -> int:
        return prefix[end] - prefix[start] + (costs.first if start == 0 else 0) + (costs.last if end == n else 0)

    infinity = float("inf")
    # best[s][i]: the smallest costliest-stage cost of the first i layers in s stages; cut[s][i]: where the last starts
    best = [[infinity] * (n + 1) for _ in range(slots + 1)]
    cut = [[0] * (n + 1) for _ in range(slots + 1)]
    best[0][0] = 0
    for s in range(1, slots + 1):
        for i in range(s, n - (slots - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], stage_cost(j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    counts: list[int] = []
    end = n
    for s in range(slots, 0, -1):
        start = cut[s][end]
        counts.append(end - start)
        end = start
    return counts[::-1]
