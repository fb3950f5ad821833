"""The option groups the engines take whole (`options=`): defined once, validated once, equal to what the
ColossalAI keywords build, and never mixed silently with those keywords."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_zero import (
    ClipOptions,
    ConstantGradScaler,
    DynamicGradScaler,
    GeminiDDP,
    GeminiOptimizer,
    GeminiOptimizerOptions,
    GeminiOptions,
    LossScaleOptions,
    LowLevelZeroOptimizer,
    LowLevelZeroOptions,
    NormType,
    Precision,
    ZeroStage,
)
from zero_gemini_helpers import make_gpt


def test_zero_precision_one_spelling() -> None:
    for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        assert Precision.parse(name) is Precision.parse(dtype)
        assert Precision.parse(name).dtype == dtype
    assert Precision.parse(None) is Precision.FP32
    assert [p for p in Precision if p.needs_loss_scaling] == [Precision.FP16]
    with pytest.raises(ValueError, match=r"unsupported precision 'fp8'; accepted: 'fp16', 'bf16'"):
        Precision.parse("fp8", (Precision.FP16, Precision.BF16))
    with pytest.raises(ValueError, match=r"forced_dtype=torch\.float64 is not supported; accepted: torch\.float32"):
        Precision.parse(torch.float64, what="forced_dtype")


def test_zero_loss_scale_and_clip_groups_validate_once() -> None:
    scaler = LossScaleOptions(initial_scale=8, growth_interval=3, hysteresis=1).scaler(dynamic=True)
    assert isinstance(scaler, DynamicGradScaler)
    assert (scaler.scale, scaler.growth_interval, scaler.hysteresis) == (8.0, 3, 1)
    assert isinstance(LossScaleOptions().scaler(dynamic=False), ConstantGradScaler)
    with pytest.raises(ValueError, match="backoff_factor must be in"):
        LossScaleOptions(backoff_factor=2.0)
    with pytest.raises(ValueError, match="initial_scale 4 is below min_scale 8"):
        LossScaleOptions(initial_scale=4, min_scale=8)
    assert ClipOptions.of(1.0, "inf") == ClipOptions(1.0, NormType.INF)
    assert not ClipOptions().enabled
    with pytest.raises(ValueError, match="clip_grad_norm must be >= 0"):
        ClipOptions.of(float("nan"), 2.0, name="clip_grad_norm")


def _inner() -> torch.optim.Optimizer:
    return torch.optim.AdamW(nn.Linear(4, 4).parameters(), lr=1e-2)


@distributed(world_size=1)
def test_zero_low_level_takes_its_group_whole(rank: int, world_size: int) -> None:
    keywords = LowLevelZeroOptimizer(
        _inner(), initial_scale=2**4, clip_grad_norm=1.0, partition_grad=True, forced_dtype=torch.float16
    )
    group = LowLevelZeroOptions(
        loss_scale=LossScaleOptions(initial_scale=2**4, growth_interval=2000, max_scale=2**24),
        clipping=ClipOptions(1.0),
        stage=ZeroStage.TWO,
        forced_dtype=torch.float16,
    )
    assert keywords.options == group  # the keywords build exactly the group
    optimizer = LowLevelZeroOptimizer(_inner(), options=group)
    assert optimizer.options is group
    assert optimizer.loss_scale == 2**4
    assert optimizer.stage == 2
    with pytest.raises(ValueError, match="pass either options= or the option keywords, not both"):
        LowLevelZeroOptimizer(_inner(), initial_scale=2**8, options=group)


@distributed(world_size=1)
def test_zero_gemini_takes_its_groups_whole(rank: int, world_size: int) -> None:
    options = GeminiOptions.from_arguments(mixed_precision=torch.float16, chunk_config_dict={"chunk_size": 1000})
    assert options.needs_loss_scaling
    ddp = GeminiDDP(make_gpt(), options=options)
    assert ddp.options is options
    assert ddp.chunk_config.chunk_size == 1000
    with pytest.raises(ValueError, match="GeminiDDP: pass either options= or the option keywords, not both"):
        GeminiDDP(make_gpt(), max_prefetch=2, options=options)
    group = GeminiOptimizerOptions(LossScaleOptions(initial_scale=2**5), ClipOptions(0.5))
    optimizer = GeminiOptimizer(torch.optim.AdamW(ddp.parameters()), ddp, options=group)
    assert optimizer.loss_scale == 2**5
    assert optimizer.max_norm == 0.5
    with pytest.raises(ValueError, match="GeminiOptimizer: pass either options= or the option keywords"):
        GeminiOptimizer(torch.optim.AdamW(ddp.parameters()), ddp, max_norm=1.0, options=group)
