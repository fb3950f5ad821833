"""MoeHybridParallelPlugin with sequence parallelism against single-process fp32 training of tiny HF MoE models
with the aux loss on: all_to_all and ring_attn on the sp axis (sp 2), split_gather / ring on the tensor-parallel
group (tp 2), and on 4 ranks ep 2 x sp 2 all_to_all (dense gradients averaged over ep x sp), ep 2 x tp 2
split_gather and sp x pp 2; Qwen2-MoE and DeepSeek-V3 (shared experts) on the sp axis. Each rank routes the tokens
of its sequence shard; the aux loss still pools every token (router logits gathered over the sequence-parallel
group), so losses and parameters match one process (and, with a padding mask, the aux loss weights the right rows).
Reference semantics in moe_hybrid_test_helpers.py. Then the refused configurations."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from cx_mesh.testing import distributed
from cx_plugins import Booster, MoeHybridParallelPlugin
from moe_hybrid_test_helpers import deepseek_v3, mixtral, qwen2_moe, qwen3_moe, rows, train_and_compare, unrouted

pytest.importorskip("transformers")


@distributed(world_size=2)
@pytest.mark.parametrize(
    ("model", "sizes", "zero_stage"),
    [
        ("mixtral", {"tp_size": 1, "sp_size": 2, "sequence_parallelism_mode": "all_to_all"}, 0),
        ("qwen3_moe", {"tp_size": 1, "sp_size": 2, "sequence_parallelism_mode": "ring_attn"}, 1),
        ("mixtral", {"tp_size": 2, "sequence_parallelism_mode": "split_gather"}, 1),
        ("qwen3_moe", {"tp_size": 2, "sequence_parallelism_mode": "ring"}, 0),
        # the attention blocks' gathers ring with their matmuls; the MoE blocks route their shard (nothing gathered)
        ("mixtral", {"tp_size": 2, "sequence_parallelism_mode": "split_gather", "enable_sequence_overlap": True}, 1),
    ],
    ids=["all_to_all-mixtral", "ring_attn-qwen3_moe", "split_gather-mixtral", "ring-qwen3_moe", "overlap-mixtral"],
)
def test_plugins_moe_hybrid_sequence_parallel(
    rank: int, world_size: int, model: str, sizes: dict[str, Any], zero_stage: int
) -> None:
    plugin = MoeHybridParallelPlugin(
        pp_size=1, ep_size=1, precision="fp32", zero_stage=zero_stage, enable_sequence_parallelism=True, **sizes
    )
    train_and_compare(plugin, model_fn=mixtral if model == "mixtral" else qwen3_moe, clip=0.05)


@distributed(world_size=2)
@pytest.mark.parametrize(
    ("model", "mode"), [("qwen2_moe", "all_to_all"), ("qwen2_moe", "ring_attn"), ("deepseek_v3", "all_to_all")]
)
def test_plugins_moe_hybrid_sp2_shared_experts(rank: int, world_size: int, model: str, mode: str) -> None:
    """Qwen2-MoE (gated shared expert) and DeepSeek-V3 (shared experts, latent attention) on the sp axis. (DeepSeek-V3
    with ring_attn is refused: its value heads are narrower than its query/key heads.)"""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=1, sp_size=2, precision="fp32", enable_sequence_parallelism=True,
        sequence_parallelism_mode=mode,
    )  # fmt: skip
    train_and_compare(plugin, model_fn=qwen2_moe if model == "qwen2_moe" else deepseek_v3)


@distributed(world_size=4)
@pytest.mark.parametrize(
    ("sizes", "zero_stage", "unrouted_experts"),
    [
        ({"tp_size": 1, "sp_size": 2, "sequence_parallelism_mode": "all_to_all"}, 0, False),
        ({"tp_size": 1, "sp_size": 2, "sequence_parallelism_mode": "all_to_all"}, 2, True),
        ({"tp_size": 2, "sequence_parallelism_mode": "split_gather"}, 1, False),
    ],
    ids=["all_to_all-zero0", "all_to_all-zero2-unrouted", "split_gather-zero1"],
)
def test_plugins_moe_hybrid_ep2_sp2(
    rank: int, world_size: int, sizes: dict[str, Any], zero_stage: int, unrouted_experts: bool
) -> None:
    """ep 2 x sp 2: each rank routes its shard through the ep all-to-all with the ep peer holding the same shard;
    with experts 2 and 3 (ep rank 1's) reached by no token of any shard, nothing hangs and the result is the same."""
    plugin = MoeHybridParallelPlugin(
        pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage, enable_sequence_parallelism=True, **sizes
    )
    assert (plugin.ep_size, plugin.dp_size) == (2, 2)
    model_fn = unrouted(lambda: mixtral(top_k=1)) if unrouted_experts else mixtral
    train_and_compare(plugin, model_fn=model_fn, clip=0.05)


@distributed(world_size=4)
@pytest.mark.parametrize(
    ("model", "sizes"),
    [
        ("mixtral", {"tp_size": 1, "sp_size": 2, "sequence_parallelism_mode": "all_to_all"}),
        ("qwen3_moe", {"tp_size": 2, "sequence_parallelism_mode": "split_gather"}),
    ],
    ids=["all_to_all-mixtral", "split_gather-qwen3_moe"],
)
def test_plugins_moe_hybrid_sequence_parallel_with_pipeline(
    rank: int, world_size: int, model: str, sizes: dict[str, Any]
) -> None:
    """sp x pp 2: stages pass sequence shards on; every layer's router logits, gathered over the sequence-parallel
    group, travel to the last stage, whose aux loss pools all tokens of the micro-batch as one process's does."""
    plugin = MoeHybridParallelPlugin(
        pp_size=2, ep_size=1, num_microbatches=2, precision="fp32", zero_stage=1, enable_sequence_parallelism=True,
        **sizes,
    )  # fmt: skip
    train_and_compare(plugin, model_fn=mixtral if model == "mixtral" else qwen3_moe, clip=0.05)


@distributed(world_size=2)
def test_plugins_moe_hybrid_sp_bad_configurations(rank: int, world_size: int) -> None:
    """Sizes that do not fit name the ones that would; what cx does not support yet says so, on every rank."""
    from cx_plugins._layout import LayoutError
    from cx_plugins.hybrid._options import SequenceParallelism
    from cx_shardformer.policies import MixtralForCausalLMPolicy

    sequence: dict[str, Any] = {"enable_sequence_parallelism": True, "sequence_parallelism_mode": "all_to_all"}
    with pytest.raises(LayoutError, match=r"not divisible by ep\*sp = 2\*2 = 4; ep_size can be 1 \(with sp_size=2\)"):
        MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, sp_size=2, **sequence)
    with pytest.raises(ValueError, match=r"enable_sequence_overlap overlaps split_gather .* is 'all_to_all'"):
        MoeHybridParallelPlugin(tp_size=2, pp_size=1, ep_size=1, enable_sequence_parallelism=True,
                                enable_sequence_overlap=True)  # MoE's default mode: nothing to overlap  # fmt: skip
    plugin = MoeHybridParallelPlugin(
        tp_size=2, pp_size=1, ep_size=1, precision="fp32", enable_sequence_parallelism=True,
        sequence_parallelism_mode="split_gather", custom_policy=MixtralForCausalLMPolicy(expert_tensor_parallel=True),
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"split_gather .* expert_tensor_parallel=True"):
        Booster(plugin=plugin).boost(mixtral())
    default = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=1, sp_size=2, enable_sequence_parallelism=True)
    assert default.options.sp_mode is SequenceParallelism.ALL_TO_ALL, "ColossalAI's MoE plugin defaults to all_to_all"
    assert default.sp_size == 2
    ring = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=1, sp_size=2, enable_sequence_parallelism=True,
        sequence_parallelism_mode="ring_attn",
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"value heads as wide as query/key heads.*use all_to_all"):
        Booster(plugin=ring).boost(deepseek_v3())


@distributed(world_size=2)
@pytest.mark.parametrize("mode", ["all_to_all", "ring_attn"])
def test_plugins_moe_hybrid_sp_padding_mask(rank: int, world_size: int, mode: str) -> None:
    """With an attention mask the aux loss weights each token's router row by its mask entry (flattened batch-major):
    the gathered router logits must come back in the original token order (ring attention's zig-zag undone)."""
    model = mixtral()
    reference = copy.deepcopy(model)
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=1, sp_size=2, precision="fp32", enable_sequence_parallelism=True,
        sequence_parallelism_mode=mode,
    )  # fmt: skip
    boosted, *_ = Booster(plugin=plugin).boost(model)
    ids = rows(0)
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0  # right padding in row 0, a shorter one in row 2
    mask[2, 7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out = boosted(input_ids=ids, attention_mask=mask, labels=labels)
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.aux_loss, expected.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
