"""GeminiPlugin through the Booster: parity with single-process PyTorch, checkpoints across plugins and world sizes,
and clear errors for arguments cx does not support yet."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from cx_mesh import RankMismatchError
from cx_mesh.testing import distributed
from cx_plugins import Booster, GeminiPlugin
from plugins_test_helpers import assert_matches, assert_updates_close, boosted, data, reference, train

STEPS = 4


@distributed(world_size=(1, 2, 4))
def test_plugins_gemini_fp32_matches_single_process(rank: int, world_size: int) -> None:
    booster, _, model, optimizer = boosted("gemini")
    batches = data(STEPS)
    train(rank, world_size, booster, model, optimizer, batches)
    assert_matches(model, reference(batches), f"gemini, world {world_size}")


@distributed(world_size=2)
@pytest.mark.parametrize(
    "placement",
    [
        {"offload_optim_frac": 1.0},
        {"shard_param_frac": 0.5},
        {"offload_optim_frac": 1.0, "offload_param_frac": 1.0},
        {"placement_policy": "auto"},
        {"max_prefetch": 2},
        {"chunk_init_device": torch.device("cpu")},  # the model is not moved first: chunks are built on the CPU
    ],
)
def test_plugins_gemini_placements_through_plugin_arguments(
    rank: int, world_size: int, placement: dict[str, Any]
) -> None:
    booster, _, model, optimizer = boosted("gemini", **placement)
    batches = data(STEPS)
    train(rank, world_size, booster, model, optimizer, batches)
    assert_matches(model, reference(batches), f"gemini {placement}")


@distributed(world_size=2)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_plugins_gemini_low_precision_trains_like_fp32(rank: int, world_size: int, precision: str) -> None:
    """cx-zero's Gemini tests hold each precision to its own reference; here the plugin must pass the precision
    through (parameters in chunks of that dtype, fp32 masters, fp16 loss scaling), so losses follow the fp32 run's
    within the precision's rounding."""
    batches = data(STEPS)
    booster, _, model, optimizer = boosted("gemini", precision=precision, initial_scale=2**8)
    losses = train(rank, world_size, booster, model, optimizer, batches)
    fp32_booster, _, fp32_model, fp32_optimizer = boosted("gemini")
    fp32_losses = train(rank, world_size, fp32_booster, fp32_model, fp32_optimizer, batches)
    assert losses == pytest.approx(fp32_losses, rel={"bf16": 2e-2, "fp16": 2e-3}[precision])
    # measured worst tensor 0.39 (bf16) / 0.23 (fp16): a near-zero bias's Adam steps
    assert_updates_close(model, fp32_model, 0, *{"bf16": (0.6, 0.2), "fp16": (0.4, 0.1)}[precision], precision)


@distributed(world_size=2)
def test_plugins_gemini_shardformer_switches_with_tp_size_1_warn_once_and_change_nothing(
    rank: int, world_size: int
) -> None:
    """ColossalAI's examples pass `enable_fused_normalization=get_accelerator().is_available()`: with tp_size=1
    ColossalAI's Gemini ignores every ShardFormer switch, so cx accepts them with one warning naming them, and the
    training is exactly the plugin's without them."""
    switches = {
        "enable_all_optimization": True,
        "enable_fused_normalization": True,
        "enable_flash_attention": True,
        "enable_sequence_parallelism": True,
        "enable_jit_fused": True,
        "enable_sequence_overlap": True,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        booster, _, model, optimizer = boosted("gemini", **switches)
    mentioning = [w for w in caught if "ShardFormer" in str(w.message)]
    assert len(mentioning) == 1, [str(w.message) for w in caught]
    assert all(f"{name}=True" in str(mentioning[0].message) for name in switches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GeminiPlugin(enable_fused_normalization=True, precision="fp32")
    assert [str(w.message).split(" ignored")[0] for w in caught] == ["GeminiPlugin: enable_fused_normalization=True"]
    batches = data(STEPS)
    train(rank, world_size, booster, model, optimizer, batches)
    assert_matches(model, reference(batches), "gemini with ShardFormer switches at tp_size=1")


@distributed(world_size=2)
def test_plugins_gemini_bad_arguments(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match=r"is not divisible by tp_size = 3; tp_size can be 1(, 2 or 4| or 2)$"):
        GeminiPlugin(tp_size=3)
    with pytest.raises(ValueError, match=r"fp8_communication=True needs fp32 master weights"):
        GeminiPlugin(fp8_communication=True, precision="fp32")  # fp8 would round the only copy of the weights
    with pytest.raises(ValueError, match=r"unsupported precision 'fp8'"):
        GeminiPlugin(precision="fp8")
    with pytest.raises(
        ValueError, match=r"is not divisible by extra_dp_size = 3; extra_dp_size can be 1(, 2 or 4| or 2)$"
    ):
        GeminiPlugin(extra_dp_size=3)
    with pytest.raises(RankMismatchError, match="ranks disagree on GeminiPlugin options"):
        GeminiPlugin(max_norm=1.0 if rank == 1 else 0.0)
    with pytest.raises(ValueError, match="placement_policy='foo' is not supported"):  # at construction, not boost
        GeminiPlugin(placement_policy="foo", precision="fp32")
    linear = torch.nn.Linear(4, 4)
    booster = Booster(plugin=GeminiPlugin(gpu_margin_mem_ratio=0.5, precision="fp32"))
    with pytest.raises(ValueError, match="placement_policy='auto' only"):
        booster.boost(linear, torch.optim.SGD(linear.parameters(), lr=0.1))
    linear = torch.nn.Linear(4, 4)
    booster = Booster(plugin=GeminiPlugin(placement_policy="auto", gpu_margin_mem_ratio=0.5, precision="fp32"))
    _, boosted_optimizer, *_ = booster.boost(linear, torch.optim.SGD(linear.parameters(), lr=0.1))
    assert boosted_optimizer is not None
    plugin_booster, _, model, optimizer = boosted("gemini")
    with (
        pytest.raises(NotImplementedError, match="enable_gradient_accumulation"),
        plugin_booster.no_sync(model, optimizer),
    ):
        pass
