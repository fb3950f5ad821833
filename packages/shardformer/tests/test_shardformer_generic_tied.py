"""Tied embeddings under the generic tp-plan policy (issue 22, item 1): the LM head's weight is the embedding's, so
sharding the head shards the embedding too, and the embedding must become vocabulary-parallel (a plain
`nn.Embedding` over a vocabulary shard looks global ids up in the wrong rows). Qwen3 with tie_word_embeddings, Gemma
and Gemma 3 (tied by default, sqrt(hidden)-scaled embedding) at tp 2 against one process: loss at every SGD step,
every gradient, every parameter after three steps. Skips without transformers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_shardformer import ShardConfig, ShardFormer, VocabParallelEmbedding1D
from cx_shardformer.policies import TPPlanPolicy, get_autopolicy
from shardformer_helpers import assert_close
from shardformer_models import build, compare_grads, compare_state, tokens, twin

pytest.importorskip("transformers")

# make_vocab_size_divisible_by=1 splits the vocabulary of 50 as 25 / 25, so the ids fall in both ranks' shards
CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("qwen3", {"tie_word_embeddings": True}, {"make_vocab_size_divisible_by": 1}),
    ("qwen3", {"tie_word_embeddings": True}, {}),  # padded to 128: rank 1 holds only padding rows
    ("gemma", {}, {"make_vocab_size_divisible_by": 1}),
    ("gemma3", {}, {"make_vocab_size_divisible_by": 1, "parallel_output": False}),
    ("qwen3", {"tie_word_embeddings": True},
     {"make_vocab_size_divisible_by": 1, "enable_sequence_parallelism": True,
      "sequence_parallelism_mode": "split_gather"}),
]  # fmt: skip
LR, STEPS = 0.1, 3


@distributed(world_size=2)
@pytest.mark.parametrize(("kind", "overrides", "config"), CASES)
def test_shardformer_generic_tied_embeddings_train_like_unsharded(
    rank: int, world_size: int, kind: str, overrides: dict[str, Any], config: dict[str, Any]
) -> None:
    model: Any = build(kind, **overrides)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the case must be tied"
    assert isinstance(get_autopolicy(model), TPPlanPolicy), "no hand-written policy: the generic one is chosen"
    reference: Any = twin(model)
    embed_scale = getattr(reference.model.embed_tokens, "embed_scale", None)
    model, _ = ShardFormer(ShardConfig(**config)).optimize(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    what = f"{kind} {overrides} {config}"
    for step in range(STEPS):
        ids = tokens(step)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        ref_out = reference(input_ids=ids, labels=ids, use_cache=False)
        assert_close(out.loss, ref_out.loss.detach(), f"{what} loss step {step}")
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        out.loss.backward()
        ref_out.loss.backward()
        if step == 0:
            compare_grads(model, reference, what)
        optimizer.step()
        ref_optimizer.step()
    # each SGD update is LR x a gradient equal within (1e-5, 1e-6): after 3 steps the parameters stay within them
    compare_state(model, reference, f"{what} after {STEPS} SGD steps")
    embedding = model.model.embed_tokens
    assert isinstance(embedding, VocabParallelEmbedding1D)
    assert model.lm_head.weight is embedding.weight, "still tied: one shard serves the embedding and the head"
    if embed_scale is not None:
        assert_close(embedding(tokens(0)), reference.model.embed_tokens(tokens(0)).detach(), "scaled embedding")


@distributed(world_size=2)
def test_shardformer_generic_tie_to_an_unshardable_module_is_refused(rank: int, world_size: int) -> None:
    """A head tied to a parameter the generic policy cannot make vocabulary-parallel is refused by name."""
    model: Any = build("qwen3")
    model.model.extra = nn.Linear(16, 50, bias=False)
    model.model.extra.weight = model.lm_head.weight
    with pytest.raises(NotImplementedError, match=r"model\.extra\.weight"):
        ShardFormer(ShardConfig()).optimize(model)
