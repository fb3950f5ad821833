"""Sequence parallelism at 2 ranks on tiny transformers models against the unsharded copy: split_gather (with tp 2),
all_to_all and ring (sp 2): the loss is the full-sequence loss, logits and every gradient equal; GQA (key/value heads
fewer than sp) under all_to_all; a sequence length that does not divide fails clearly. Skips without transformers."""

from __future__ import annotations

import pytest

from cx_mesh.testing import distributed
from cx_shardformer import ShardConfig, ShardFormer
from shardformer_helpers import assert_close
from shardformer_models import VOCAB, build, compare_grads, full_logits, tokens, twin

pytest.importorskip("transformers")

CASES = [
    ("llama", "split_gather", {}),
    ("gpt2", "split_gather", {}),
    ("llama", "all_to_all", {}),
    ("llama", "all_to_all", {"num_key_value_heads": 1}),
    ("gpt2", "all_to_all", {}),
    ("llama", "ring", {}),
    ("gpt2", "ring", {}),
]


def _config(mode: str) -> ShardConfig:
    tp = mode == "split_gather"
    return ShardConfig(
        enable_tensor_parallelism=tp,
        enable_sequence_parallelism=True,
        sequence_parallelism_mode=mode,
        parallel_output=False,
    )


@distributed(world_size=2)
@pytest.mark.parametrize(("kind", "mode", "overrides"), CASES)
def test_shardformer_sequence_parallel_matches_unsharded(
    rank: int, world_size: int, kind: str, mode: str, overrides: dict[str, int]
) -> None:
    model = build(kind, **overrides)
    reference = twin(model)
    model, _ = ShardFormer(_config(mode)).optimize(model)
    ids = tokens(0)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    ref_out = reference(input_ids=ids, labels=ids, use_cache=False)
    assert out.logits.shape == (ids.shape[0], ids.shape[1], VOCAB), "logits cover the full sequence"
    assert_close(out.loss, ref_out.loss.detach(), f"{kind} {mode} loss")
    assert_close(full_logits(out.logits, False), ref_out.logits.detach(), f"{kind} {mode} logits")
    out.loss.backward()
    ref_out.loss.backward()
    compare_grads(model, reference, f"{kind} {mode}")


@distributed(world_size=2)
@pytest.mark.parametrize(
    ("mode", "seq", "match"),
    [
        ("split_gather", 7, "not divisible by 2"),
        ("all_to_all", 7, "not divisible by 2"),
        ("ring", 6, "not divisible by 4"),
    ],
)
def test_shardformer_sequence_length_must_divide(rank: int, world_size: int, mode: str, seq: int, match: str) -> None:
    model, _ = ShardFormer(_config(mode)).optimize(build("llama"))
    ids = tokens(0, seq)
    with pytest.raises(ValueError, match=f"sequence length {seq} is {match}"):
        model(input_ids=ids, labels=ids, use_cache=False)
