"""Bad configurations fail at optimize time, on every rank, naming the model and the numbers: attention heads or
key/value heads not divisible by tp, heads not divisible by sp under all_to_all, a model without a policy, and
unsupported tp-plan styles. Token ids and labels outside the vocabulary raise at forward on every rank, as one process
of torch does. Skips without transformers."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh import RankMismatchError
from cx_mesh.testing import distributed
from cx_shardformer import ShardConfig, ShardFormer
from cx_shardformer.policies import NoPolicyError, TPPlanPolicy
from shardformer_models import build

pytest.importorskip("transformers")

CASES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    (
        "llama",
        {"num_attention_heads": 1, "num_key_value_heads": 1},
        {},
        "LlamaForCausalLM: num_attention_heads=1 is not divisible by the tensor parallel size 2",
    ),
    (
        "llama",
        {"num_key_value_heads": 1},
        {},
        "LlamaForCausalLM: num_key_value_heads=1 is not divisible by the tensor parallel size 2",
    ),
    ("gpt2", {"n_head": 1}, {}, "GPT2LMHeadModel: n_head=1 is not divisible by the tensor parallel size 2"),
    (
        "llama",
        {"num_attention_heads": 2, "num_key_value_heads": 2},
        {
            "enable_tensor_parallelism": True,
            "enable_sequence_parallelism": True,
            "sequence_parallelism_mode": "all_to_all",
        },
        "scatters the 1 attention heads each tensor-parallel rank holds",
    ),
]


@distributed(world_size=2)
@pytest.mark.parametrize(("kind", "overrides", "config", "message"), CASES)
def test_shardformer_bad_head_counts_fail_clearly(
    rank: int, world_size: int, kind: str, overrides: dict[str, Any], config: dict[str, Any], message: str
) -> None:
    model = build(kind, **overrides)
    with pytest.raises(ValueError, match=message):
        ShardFormer(ShardConfig(**config)).optimize(model)


@distributed(world_size=2)
def test_shardformer_without_policy_or_with_unknown_plan(rank: int, world_size: int) -> None:
    with pytest.raises(NoPolicyError, match="no policy for Sequential") as caught:
        ShardFormer(ShardConfig()).optimize(nn.Sequential(nn.Linear(2, 2)))
    assert isinstance(caught.value, TypeError)
    assert str(caught.value).endswith("; pass policy=... to ShardFormer.optimize")
    copied = copy.copy(caught.value)  # rebuilt from its args, as when it travels between ranks
    assert (type(copied), str(copied), copied.model_class) == (NoPolicyError, str(caught.value), "Sequential")
    model: Any = build("llama")
    model.config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise_rep"}
    with pytest.raises(NotImplementedError, match="styles \\['colwise_rep'\\] are not supported"):
        ShardFormer(ShardConfig()).optimize(model, TPPlanPolicy())


@distributed(world_size=2)
def test_shardformer_ranks_that_disagree_fail_on_every_rank(rank: int, world_size: int) -> None:
    """A rank with another setting fails at optimize on every rank, naming the field (no hang later)."""
    model = build("llama")
    with pytest.raises(RankMismatchError, match="parallel_output"):
        ShardFormer(ShardConfig(parallel_output=rank == 0)).optimize(model)


@distributed(world_size=2)
@pytest.mark.parametrize(("where", "bad"), [("input_ids", 69), ("input_ids", -1), ("labels", 300), ("labels", -1)])
def test_shardformer_ids_outside_vocabulary_raise(rank: int, world_size: int, where: str, bad: int) -> None:
    """Llama at vocabulary 64 over tp 2 (vocabulary-parallel embedding and loss): a bad input id or label raises an
    IndexError naming it on both ranks instead of a zero embedding or a loss of 0 / inf; -100 labels are ignored."""
    model: Any = build("llama", vocab_size=64)
    ShardFormer(ShardConfig()).optimize(model)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :3] = -100
    assert torch.isfinite(model(input_ids=ids, labels=labels).loss)
    (ids if where == "input_ids" else labels)[1, 4] = bad
    what = "input id" if where == "input_ids" else "label"
    with pytest.raises(IndexError, match=f"{what} {bad} is outside the vocabulary of size 64"):
        model(input_ids=ids, labels=labels)
