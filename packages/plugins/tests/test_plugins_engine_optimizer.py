"""The package's seams: one boosted optimizer (`EngineOptimizer`) over cx-zero's engines through the
`OptimizerEngine` protocol, the option groups the plugins build once and hand whole to the engines, and the Booster
checking checkpoint IO by capability (protocol), not by class."""

from __future__ import annotations

import pytest
import torch
from torch.optim import Optimizer

from cx_checkpoint import Stateful
from cx_mesh import RankMismatchError
from cx_mesh.testing import TEST_ADAM_EPS, distributed
from cx_plugins import Booster, EngineOptimizer, GeminiPlugin, LowLevelZeroPlugin, OptimizerEngine, TorchDDPPlugin
from cx_plugins.checkpoint_io._replicated import ReplicatedCheckpointIO
from cx_plugins.models import GPT
from cx_zero import (
    ClipOptions,
    GeminiOptimizer,
    LossScaleOptions,
    LowLevelZeroOptimizer,
    NormType,
    Precision,
    ZeroStage,
)
from plugins_test_helpers import CONFIG, LR, assert_matches, boosted, data, train


def _as_engine(engine: LowLevelZeroOptimizer | GeminiOptimizer) -> OptimizerEngine:
    return engine  # mypy --strict checks here that both engines satisfy the protocol


def _clipped_reference(batches: torch.Tensor, max_norm: float) -> torch.nn.Module:
    model = GPT(CONFIG, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=TEST_ADAM_EPS)
    for batch in batches:
        model(batch, labels=batch).backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
    return model


@distributed(world_size=2)
@pytest.mark.parametrize("plugin", ["zero2", "gemini"])
@pytest.mark.parametrize("max_norm", [0.0, 0.05])
def test_plugins_one_engine_optimizer_trains_like_pytorch(
    rank: int, world_size: int, plugin: str, max_norm: float
) -> None:
    """The plugin's `max_norm` reaches the engine inside the clipping group: every step clips like torch's
    clip_grad_norm_ on one process (0.05 is well below this model's gradient norm, so every step clips)."""
    booster, _, model, optimizer = boosted(plugin, max_norm=max_norm)
    assert isinstance(optimizer, EngineOptimizer)
    assert isinstance(optimizer.engine, LowLevelZeroOptimizer | GeminiOptimizer)
    assert _as_engine(optimizer.engine) is optimizer.engine
    batches = data(3)
    train(rank, world_size, booster, model, optimizer, batches)
    assert_matches(model, _clipped_reference(batches, max_norm), f"{plugin} max_norm={max_norm}")


@distributed(world_size=1)
def test_plugins_gemini_engine_refuses_what_it_cannot_do(rank: int, world_size: int) -> None:
    _, _, model, optimizer = boosted("gemini")
    batch = data(1)[0]
    loss = model(batch, labels=batch)
    with pytest.raises(NotImplementedError, match="retain_graph=True"):
        optimizer.backward(loss, retain_graph=True)
    with pytest.raises(NotImplementedError, match="backward_by_grad is not supported"):
        optimizer.backward_by_grad(loss, torch.ones_like(loss))
    with pytest.raises(ValueError, match="does not take a closure"):
        optimizer.step(lambda: 0.0)


@distributed(world_size=1)
def test_plugins_build_the_engine_groups_once(rank: int, world_size: int) -> None:
    zero = LowLevelZeroPlugin(stage=2, precision="bf16", initial_scale=2**10, max_norm=1.5, norm_type=float("inf"))
    assert zero.options.zero.loss_scale == LossScaleOptions(initial_scale=2**10, max_scale=2**32)
    assert zero.options.zero.clipping == ClipOptions(1.5, NormType.INF)
    assert zero.options.zero.stage is ZeroStage.TWO
    assert zero.options.precision is Precision.BF16
    gemini = GeminiPlugin(precision="fp16", hysteresis=3, max_norm=2.0, chunk_config_dict={"chunk_size": 100})
    assert gemini.options.optimizer.loss_scale.hysteresis == 3
    assert gemini.options.optimizer.clipping.max_norm == 2.0
    assert gemini.options.ddp.mixed_precision == torch.float16
    assert gemini.options.ddp.chunk_config is not None
    assert gemini.options.ddp.chunk_config.chunk_size == 100
    # bad values fail at construction, with the plugin's own names
    with pytest.raises(ValueError, match="LowLevelZeroPlugin: max_norm must be >= 0"):
        LowLevelZeroPlugin(max_norm=-1.0)
    with pytest.raises(ValueError, match="growth_factor must be > 1"):
        GeminiPlugin(growth_factor=0.5)
    with pytest.raises(ValueError, match="do not apply when chunk_config_dict is given"):
        GeminiPlugin(chunk_config_dict={"chunk_size": 100}, search_range_m=4)
    # one precision spelling: names and dtypes parse to the same member, and both are refused alike
    assert Precision.parse("bf16") is Precision.parse(torch.bfloat16) is Precision.BF16
    with pytest.raises(ValueError, match=r"communication_dtype=torch\.float64 is not supported"):
        LowLevelZeroPlugin(communication_dtype=torch.float64)


class _ScalerKeepingIO(ReplicatedCheckpointIO):
    """Not the class the Booster used to check for: it is asked by capability now."""

    def __init__(self) -> None:
        super().__init__()
        self.registered: list[tuple[Optimizer, Stateful]] = []

    def register_loss_scaler(self, optimizer: Optimizer, scaler: Stateful) -> None:
        self.registered.append((optimizer, scaler))
        super().register_loss_scaler(optimizer, scaler)


class _PluginWithOwnIO(TorchDDPPlugin):
    def get_checkpoint_io(self) -> _ScalerKeepingIO:
        return _ScalerKeepingIO()


@distributed(world_size=1)
def test_booster_checks_checkpoint_io_by_capability(rank: int, world_size: int) -> None:
    booster = Booster(mixed_precision="fp16", plugin=_PluginWithOwnIO())
    linear = torch.nn.Linear(4, 4)
    _, optimizer, *_ = booster.boost(linear, torch.optim.SGD(linear.parameters(), lr=0.1))
    assert optimizer is not None
    io = booster.checkpoint_io
    assert isinstance(io, _ScalerKeepingIO)
    assert [registered for registered, _ in io.registered] == [optimizer.unwrap()]


@distributed(world_size=2)
def test_plugins_gemini_ranks_agree_on_their_own_accelerator(rank: int, world_size: int) -> None:
    """ColossalAI scripts pass `chunk_init_device=get_current_device()`: cuda:0 on rank 0, cuda:1 on rank 1. That is
    the same option (compared by kind); a different kind is not."""
    GeminiPlugin(chunk_init_device=torch.device("cuda", rank))  # constructing only: no device is touched
    with pytest.raises(RankMismatchError, match="GeminiPlugin options"):
        GeminiPlugin(chunk_init_device=torch.device("cpu" if rank else "cuda"))
