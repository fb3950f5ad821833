"""`gemini_gathered_elements`: how many 16-bit parameter elements GeminiPlugin holds gathered at once on a rank.

GeminiDDP (cx-zero over cx-chunk's ChunkManager) packs the parameters into chunks sharded over the dp ranks, gathers
a chunk when one of its parameters is used and releases it when none is in use any more (forward) or when all its
parameters have their gradients (backward, where the gradients are written into the gathered chunk and reduced from
it). So what is gathered at once is not the whole model but:
- the long-lived parameters (a unit such as the model's root, whose forward encloses more than a chunk's worth of
  others: the embeddings, final norm and LM head), set apart in chunks of their own and gathered through the step;
- the chunks spanned by the decoder layer in use: a layer's units (its norms, attention, MLP) are gathered while
  the layer runs, and in the backward a chunk it shares with the next layer stays gathered until both are done.
The chunk size is the one the plugin searches (`search_chunk_configuration` with the `GEMINI_*` arguments
`make_plugin` gives it), over the parameters in model order, refined without the set-apart ones as
GeminiDDP does; a model below the search's minimum is one keep_gathered chunk, the whole model, as before.
The layout is rebuilt here from the model built on the meta device (no memory), the long-lived parameters taken as
those outside the numbered layers (GeminiDDP's `long_lived_params` rule on these models) when the layers exceed a
chunk. Prefetch adds nothing: cx's plugins run `max_prefetch=0`. Measured within 1 % on a Llama of eight chunks
(tests/test_plan_memory.py), where the whole model counted gathered was 18 % over.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import torch
from torch import nn

from cx_chunk import ChunkConfig, search_chunk_configuration
from cx_plan._candidate import Candidate
from cx_plan.trace._model_spec import ModelShape, build_model

__all__ = [
    "GEMINI_HIDDEN_DIM",
    "GEMINI_MIN_CHUNK_SIZE_M",
    "GEMINI_SEARCH_RANGE_M",
    "gathered_in",
    "gemini_gathered_elements",
]

# the chunk search make_plugin runs (cx's models are small next to the search's defaults: small chunks, so they are
# really sharded)
GEMINI_SEARCH_RANGE_M = 1
GEMINI_MIN_CHUNK_SIZE_M = 0.05
GEMINI_HIDDEN_DIM = 64
_LAYER = re.compile(r"^(.*?\.\d+)\.")  # a parameter inside a numbered layer: "model.layers.3.mlp.up_proj.weight"


def _search(sizes: Sequence[int], dp: int) -> ChunkConfig:
    tensors = [torch.empty(size, device="meta") for size in sizes]
    return search_chunk_configuration(
        tensors,
        GEMINI_SEARCH_RANGE_M,
        min_chunk_size_m=GEMINI_MIN_CHUNK_SIZE_M,
        hidden_dim=GEMINI_HIDDEN_DIM,
        group_size=dp,
    ).config


def _next_fit(sizes: Sequence[int], config: ChunkConfig) -> tuple[list[int], list[int]]:
    """(the chunk index of each tensor, each chunk's elements) as ChunkManager.register_tensor packs them."""
    where: list[int] = []
    chunks: list[int] = []
    fill = config.chunk_size  # no open chunk
    open_index = -1
    for size in sizes:
        if config.gets_own_chunk(size):
            chunks.append(size)
            where.append(len(chunks) - 1)
            continue
        if fill + size > config.chunk_size:
            chunks.append(config.chunk_size)
            open_index, fill = len(chunks) - 1, 0
        fill += size
        where.append(open_index)
    return where, chunks


@functools.lru_cache(maxsize=16)
def gemini_gathered_elements(shape: ModelShape, dp: int, tp: int = 1) -> int:
    """`gathered_in` the model of `shape`, built on the meta device; at tp > 1 one tp rank's part of it (ShardFormer's
    split, which GeminiPlugin chunks: the sharded matrices 1/tp, the replicated ones whole)."""
    if tp > 1:
        from cx_plan.trace._activations import tp_rank_model  # the fake-world trace machinery, only when needed

        return gathered_in(tp_rank_model(shape, Candidate("gemini", dp=dp, tp=tp)), dp)
    with torch.device("meta"):
        model = build_model(shape)
    return gathered_in(model, dp)


def gathered_in(model: nn.Module, dp: int) -> int:
    """Elements (padding included) of the chunks gathered at once when GeminiPlugin trains `model` over `dp` ranks:
    the set-apart long-lived chunks plus the chunks of the layer that spans the most, at most the whole model
    (module docstring)."""
    named = [(name, p.numel()) for name, p in model.named_parameters() if p.requires_grad]
    config = _search([size for _, size in named], dp)
    total = sum(size for _, size in named)
    if config.keep_gathered:  # one chunk, gathered throughout
        return -(-total // dp) * dp
    layers = [(match.group(1) if (match := _LAYER.match(name)) else None, size) for name, size in named]
    inner = sum(size for layer, size in layers if layer is not None)
    apart = 0
    if inner > config.chunk_size:  # the outer units enclose more than a chunk: their parameters are set apart
        apart = sum(size for layer, size in layers if layer is None)
        layers = [(layer, size) for layer, size in layers if layer is not None]
        refined = _search([size for _, size in layers], dp)
        config = config if refined.keep_gathered else refined
    where, chunks = _next_fit([size for _, size in layers], config)
    spanned: dict[str | None, set[int]] = {}
    for (layer, _), index in zip(layers, where, strict=True):
        spanned.setdefault(layer, set()).add(index)
    largest = max(sum(chunks[i] for i in indices) for indices in spanned.values())
    return min(apart + largest, apart + sum(chunks))
