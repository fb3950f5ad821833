"""Each bad HybridParallelPlugin configuration raises its clear error on every rank (no hang, no deep traceback),
custom_policy of the wrong type included; misuse at boost and execute_pipeline (an empty data iterator, a model
without a policy) names what to pass instead."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch

from cx_mesh import RankMismatchError
from cx_mesh.testing import distributed
from cx_pipeline import EmptyDataIterError, PipelineConfigError
from cx_plugins import Booster, HybridParallelPlugin, TorchDDPPlugin
from cx_plugins._layout import LayoutError
from cx_shardformer.policies import LlamaForCausalLMPolicy, NoPolicyError

BAD_OPTIONS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"tp_size": 3, "pp_size": 1}, LayoutError, "the world size 2 is not divisible by tp_size = 3"),
    ({"tp_size": 1, "pp_size": 2}, ValueError, "needs num_microbatches or microbatch_size"),
    ({"tp_size": 1, "pp_size": 1, "zero_stage": 3}, ValueError, "zero_stage must be 0, 1 or 2"),
    ({"tp_size": 1, "pp_size": 1, "precision": "fp8"}, ValueError, "unsupported precision 'fp8'"),
    ({"tp_size": 1, "pp_size": 1, "inner_ring_size": 2}, NotImplementedError, "double-ring attention"),
    ({"tp_size": 1, "pp_size": 2, "num_microbatches": 2, "pp_style": "gpipe"}, ValueError, "unknown pp_style"),
    (
        {"tp_size": 1, "pp_size": 2, "num_microbatches": 2, "pp_style": "interleaved"},
        ValueError,
        "needs num_model_chunks >= 2",
    ),
    ({"tp_size": 1, "pp_size": 2, "num_microbatches": 2, "pp_style": "zbv"}, ValueError, "needs num_model_chunks=2"),
    (
        {"tp_size": 2, "pp_size": 1, "sp_size": 2, "enable_sequence_parallelism": True},
        ValueError,
        "runs on the tensor-parallel group; sp_size must be 1",
    ),
    ({"tp_size": 1, "pp_size": 1, "sequence_parallelism_mode": "all_to_all"}, ValueError, "needs enable_sequence"),
    ({"tp_size": 1, "pp_size": 1, "enable_sequence_parallelism": True}, ValueError, "needs tp_size > 1"),
    (
        {"tp_size": 1, "pp_size": 1, "enable_sequence_parallelism": True, "sequence_parallelism_mode": "zigzag"},
        ValueError,
        "unknown sequence_parallelism_mode",
    ),
    (
        {"tp_size": 2, "pp_size": 1, "enable_sequence_overlap": True},
        ValueError,
        "sequence parallelism is 'off' here",
    ),
    ({"tp_size": 1, "pp_size": 1, "cpu_offload": True}, ValueError, "cpu_offload"),
    ({"tp_size": 1, "pp_size": 1, "ddp_bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be positive, got 0"),
    ({"tp_size": 1, "pp_size": 1, "max_norm": -1.0}, ValueError, "max_norm must be >= 0"),
    (
        {"tp_size": 1, "pp_size": 1, "custom_policy": "LlamaPolicy"},
        TypeError,
        "HybridParallelPlugin: custom_policy must be a cx_shardformer Policy instance (e.g. cx_shardformer.policies."
        "LlamaForCausalLMPolicy()) or None, got str 'LlamaPolicy'",
    ),
    (
        {"tp_size": 1, "pp_size": 1, "custom_policy": LlamaForCausalLMPolicy},
        TypeError,
        "custom_policy must be a Policy instance, got the class LlamaForCausalLMPolicy; pass "
        "custom_policy=LlamaForCausalLMPolicy()",
    ),
]


@distributed(world_size=2)
@pytest.mark.parametrize("case", range(len(BAD_OPTIONS)))
def test_plugins_hybrid_bad_options(rank: int, world_size: int, case: int) -> None:
    options, error, message = BAD_OPTIONS[case]
    with pytest.raises(error, match=re.escape(message)):
        HybridParallelPlugin(**options)


@distributed(world_size=2)
def test_plugins_hybrid_idle_arguments_warn(rank: int, world_size: int) -> None:
    """Arguments that change nothing in the chosen configuration are named in one warning, with the reason; the
    defaults and arguments that act stay quiet."""
    with pytest.warns(UserWarning, match="change nothing here") as caught:
        HybridParallelPlugin(
            tp_size=2, pp_size=1, zero_bucket_size_in_m=4, communication_dtype=torch.bfloat16, num_microbatches=2,
            pp_style="interleaved", num_model_chunks=2, find_unused_parameters=True,
        )  # fmt: skip
    assert len(caught) == 1
    text = str(caught[0].message)
    for name in ("zero_bucket_size_in_m", "communication_dtype", "num_microbatches", "pp_style", "num_model_chunks"):
        assert f"{name}: " in text, name
    assert "find_unused_parameters: a torch DDP hint" in text
    with pytest.warns(UserWarning, match=r"ddp_bucket_cap_mb: the zero_stage-0 bucket size and zero_stage is 1"):
        HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=1, ddp_bucket_cap_mb=50)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HybridParallelPlugin(tp_size=2, pp_size=1)
        HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, zero_stage=1, zero_bucket_size_in_m=4)


@distributed(world_size=2)
def test_plugins_hybrid_ranks_disagree(rank: int, world_size: int) -> None:
    with pytest.raises(RankMismatchError, match="max_norm"):
        HybridParallelPlugin(tp_size=2, pp_size=1, max_norm=float(rank))


@distributed(world_size=2)
def test_plugins_hybrid_misuse(rank: int, world_size: int) -> None:
    pytest.importorskip("transformers")
    from hybrid_test_helpers import batch, llama

    plain = HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32")
    booster = Booster(plugin=plain)
    model, optimizer, *_ = booster.boost(llama(), None)
    with pytest.raises(NotImplementedError, match="execute_pipeline needs a plugin with pipeline parallelism"):
        booster.execute_pipeline(iter([batch(0)]), model, lambda out, _: out.loss)
    with pytest.raises(NotImplementedError, match="execute_pipeline needs a plugin with pipeline parallelism"):
        Booster(plugin=TorchDDPPlugin()).execute_pipeline(iter([]), model, None)

    stranger = torch.nn.Parameter(torch.zeros(2))
    net = llama()
    with pytest.raises(ValueError, match="not the model's"):
        Booster(plugin=plain).boost(net, torch.optim.SGD([*net.parameters(), stranger], lr=0.1))
    assert plain.sp_group is plain.tp_group

    piped = HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp32", num_microbatches=3)
    booster = Booster(plugin=piped)
    net = llama()
    model, optimizer, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"booster\.execute_pipeline"):
        model(**batch(0))
    with pytest.raises(PipelineConfigError, match="3"):  # 8 samples do not split into 3 micro-batches
        booster.execute_pipeline(iter([batch(0)]), model, lambda out, _: out.loss, optimizer)
    # an empty (or exhausted) iterator says so; still a StopIteration, so loops that end an epoch on it keep working
    with pytest.raises(EmptyDataIterError, match="data iterator is empty or exhausted") as caught:
        booster.execute_pipeline(iter([]), model, lambda out, _: out.loss, optimizer)
    assert isinstance(caught.value, StopIteration)


@distributed(world_size=2)
def test_plugins_hybrid_no_policy_names_custom_policy(rank: int, world_size: int) -> None:
    """A model cx-shardformer has no policy for is told to pass the plugin's custom_policy=, not ShardFormer's
    policy= (which a plugin user never calls)."""
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"))
    with pytest.raises(NoPolicyError, match=r"no policy for Sequential") as caught:
        booster.boost(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    message = str(caught.value)
    assert "pass custom_policy=<a cx_shardformer Policy instance> to HybridParallelPlugin" in message, message
    assert "ShardFormer.optimize" not in message, message


@distributed(world_size=2)
def test_plugins_hybrid_heads_not_divisible(rank: int, world_size: int) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=24, intermediate_size=48, num_attention_heads=3, num_key_value_heads=1,
        num_hidden_layers=2, use_cache=False,
    )  # fmt: skip
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"))
    with pytest.raises(ValueError, match="not divisible by the tensor parallel size 2"):
        booster.boost(transformers.LlamaForCausalLM(config))
