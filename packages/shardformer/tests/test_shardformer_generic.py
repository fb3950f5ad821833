"""The generic base_model_tp_plan policy on transformers architectures with no hand-written cx policy, at tp 2
against the unsharded model (loss, logits, every gradient): Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms,
"replicated_with_grad_allreduce"), Phi-3 (fused qkv and gate-up, "colwise_gather_output" / "rowwise_split_input");
and Qwen3 under each sequence-parallel mode. Skips without transformers."""

from __future__ import annotations

import pytest

from cx_mesh.testing import distributed
from cx_shardformer import ShardConfig, ShardFormer
from cx_shardformer.policies import TPPlanPolicy, get_autopolicy
from shardformer_helpers import assert_close
from shardformer_models import build, compare_grads, full_logits, tokens, twin

pytest.importorskip("transformers")

CASES = [
    ("qwen2", {}),
    ("qwen3", {}),
    ("phi3", {}),
    ("qwen3", {"enable_sequence_parallelism": True, "sequence_parallelism_mode": "split_gather"}),
    ("qwen3", {"enable_tensor_parallelism": False, "enable_sequence_parallelism": True,
               "sequence_parallelism_mode": "all_to_all"}),
    ("qwen3", {"enable_tensor_parallelism": False, "enable_sequence_parallelism": True,
               "sequence_parallelism_mode": "ring"}),
]  # fmt: skip


@distributed(world_size=2)
@pytest.mark.parametrize(("kind", "config"), CASES)
def test_shardformer_generic_plan_matches_unsharded(
    rank: int, world_size: int, kind: str, config: dict[str, object]
) -> None:
    model = build(kind)
    assert isinstance(get_autopolicy(model), TPPlanPolicy), "no hand-written policy: the generic one is chosen"
    reference = twin(model)
    shard_config = ShardConfig(**config)  # type: ignore[arg-type]
    model, _ = ShardFormer(shard_config).optimize(model)
    ids = tokens(5)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    ref_out = reference(input_ids=ids, labels=ids, use_cache=False)
    what = f"{kind} {config}"
    assert_close(out.loss, ref_out.loss.detach(), f"{what} loss")
    parallel = shard_config.parallel_output and shard_config.enable_tensor_parallelism
    assert_close(full_logits(out.logits, parallel), ref_out.logits.detach(), f"{what} logits")
    out.loss.backward()
    ref_out.loss.backward()
    compare_grads(model, reference, what)
