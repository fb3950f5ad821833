"""Shared pieces of the plugin tests: a tiny GPT, deterministic data, plugins by name, and the single-process
reference that replays data parallelism (each rank's micro-batch separately, gradients averaged)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cx_mesh.testing import TEST_ADAM_EPS, tiny_model_adam_tolerance
from cx_plugins import (
    Booster,
    GeminiPlugin,
    LowLevelZeroPlugin,
    ModelWrapper,
    OptimizerWrapper,
    Plugin,
    TorchDDPPlugin,
)
from cx_plugins.gemini._plugin import GeminiModel
from cx_plugins.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, max_positions=8, hidden_size=16, num_layers=1, num_heads=4)
GLOBAL_BATCH, LENGTH, LR = 4, 8, 1e-2
# Data-parallel runs and the reference differ only in the gradient mean's summation order. AdamW at TEST_ADAM_EPS
# keeps each step a smooth function of the gradient (at the default eps a near-zero gradient's rounding decides the
# sign of an lr-sized step), so the parameters differ by rounding alone, bounded from it for up to 6 steps (the
# longest run these helpers serve).
RTOL, ATOL = 1e-5, tiny_model_adam_tolerance(LR, steps=6, tokens=GLOBAL_BATCH * LENGTH)


def data(steps: int, seed: int = 99) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (steps, GLOBAL_BATCH, LENGTH), generator=generator)


def make_plugin(name: str, **options: Any) -> Plugin:
    if name == "torch_ddp":
        return TorchDDPPlugin(**options)
    if name == "gemini":  # small chunks, so the tiny model really is sharded over several chunks
        return GeminiPlugin(**{"precision": "fp32", "chunk_config_dict": {"chunk_size": 1024}, **options})
    if name.startswith("zero"):
        return LowLevelZeroPlugin(stage=int(name[-1]), **{"precision": "fp32", **options})
    raise ValueError(name)


def boosted(plugin: str, seed: int = 0, **options: Any) -> tuple[Booster, nn.Module, nn.Module, OptimizerWrapper]:
    booster = Booster(plugin=make_plugin(plugin, **options))
    plain = GPT(CONFIG, seed=seed)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    return booster, plain, model, optimizer


def train(
    rank: int, world_size: int, booster: Booster, model: nn.Module, optimizer: OptimizerWrapper, batches: torch.Tensor
) -> list[float]:
    per_rank = GLOBAL_BATCH // world_size
    losses = []
    for batch in batches:
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        loss = model(mine, labels=mine)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def reference(batches: torch.Tensor, seed: int = 0) -> nn.Module:
    model = GPT(CONFIG, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=TEST_ADAM_EPS)
    for batch in batches:
        model(batch, labels=batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors by name of a plain or boosted model (Gemini's parameters are sharded: gathered, collective)."""
    if isinstance(model, GeminiModel):
        return model.ddp.state_dict(only_rank_0=False)
    return model.unwrap().state_dict() if isinstance(model, ModelWrapper) else model.state_dict()


def assert_matches(model: nn.Module, expected: nn.Module, what: str) -> None:
    """`model` may be a plain module or a boosted one."""
    want = expected.state_dict()
    state = full_state(model)
    assert set(state) == set(want), f"{what}: names differ"
    for name, value in state.items():
        try:
            torch.testing.assert_close(value.float(), want[name], rtol=RTOL, atol=ATOL)
        except AssertionError as error:
            raise AssertionError(f"{what}, {name}: {error}") from None


def assert_updates_close(
    model: nn.Module, fp32_model: nn.Module, seed: int, tensor_rtol: float, overall_rtol: float, what: str
) -> None:
    """A low-precision run's parameters against the fp32 run's, as updates from the common initial values (the
    values themselves differ by little more than an update, so comparing them says nothing): per tensor, and over
    all tensors, |update - fp32 update| / |fp32 update|. A tensor that was not trained, or trained twice as fast,
    scores 1."""
    init = GPT(CONFIG, seed=seed).state_dict()
    mine, want = full_state(model), full_state(fp32_model)
    errors, norms = [], []
    for name in sorted(want):
        if not want[name].is_floating_point():
            continue
        update, expected = mine[name].float() - init[name], want[name].float() - init[name]
        errors.append(float((update - expected).norm()))
        norms.append(float(expected.norm()))
        if norms[-1] > 0:
            assert errors[-1] / norms[-1] < tensor_rtol, f"{what}, {name}: {errors[-1] / norms[-1]:.3f} off"
    overall = sum(e * e for e in errors) ** 0.5 / sum(n * n for n in norms) ** 0.5
    assert overall < overall_rtol, f"{what}: all parameters' updates {overall:.3f} off"
