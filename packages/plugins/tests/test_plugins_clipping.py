"""`optimizer.clip_grad_by_norm` / `clip_grad_by_value` on every plugin's boosted optimizer, between backward and
step, against `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` on a single process.

SGD, not Adam: Adam's update hardly changes when all gradients are multiplied by one factor, so it would hide a
wrong clipping coefficient. fp32 runs match the reference to rounding; fp16 runs (loss scaling) are checked on what a
clip of the scaled instead of the true gradients would get wrong by the scale (2**8 here): the returned norm, and the
step's direction and length against the fp32 reference's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import Booster, OptimizerWrapper
from cx_plugins.models import GPT
from plugins_test_helpers import CONFIG, GLOBAL_BATCH, assert_matches, data, full_state, make_plugin

STEPS, LR, MAX_NORM, CLIP_VALUE = 3, 0.5, 0.2, 0.01
PLUGINS = ["torch_ddp", "zero1", "zero2", "gemini"]


def _boost(plugin: str, precision: str) -> tuple[Booster, nn.Module, OptimizerWrapper]:
    options: dict[str, Any] = {}
    mixed = None
    if precision == "fp16":
        if plugin == "torch_ddp":
            mixed = "fp16"
        else:
            options = {"precision": "fp16", "initial_scale": 2**8}
    booster = Booster(mixed_precision=mixed, plugin=make_plugin(plugin, **options))
    plain = GPT(CONFIG, seed=0)
    model, optimizer, *_ = booster.boost(plain, torch.optim.SGD(plain.parameters(), lr=LR))
    assert optimizer is not None
    return booster, model, optimizer


def _clip(optimizer: OptimizerWrapper | torch.optim.Optimizer, params: list[nn.Parameter], kind: str) -> float:
    if isinstance(optimizer, OptimizerWrapper):
        if kind == "norm":
            return float(optimizer.clip_grad_by_norm(MAX_NORM))
        optimizer.clip_grad_by_value(CLIP_VALUE)
        return 0.0
    if kind == "norm":
        return float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
    torch.nn.utils.clip_grad_value_(params, CLIP_VALUE)
    return 0.0


def _reference(batches: torch.Tensor, kind: str) -> tuple[nn.Module, list[float], list[dict[str, torch.Tensor]]]:
    model = GPT(CONFIG, seed=0)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    norms, states = [], []
    for batch in batches:
        model(batch, labels=batch).backward()
        norms.append(_clip(optimizer, params, kind))
        optimizer.step()
        optimizer.zero_grad()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return model, norms, states


def _run(
    rank: int, world_size: int, plugin: str, precision: str, kind: str, batches: torch.Tensor
) -> tuple[nn.Module, list[float], list[dict[str, torch.Tensor]]]:
    booster, model, optimizer = _boost(plugin, precision)
    per_rank = GLOBAL_BATCH // world_size
    norms, states = [], []
    for batch in batches:
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        booster.backward(model(mine, labels=mine), optimizer)
        norms.append(_clip(optimizer, [], kind))
        optimizer.step()
        optimizer.zero_grad()
        states.append({k: v.detach().float().clone() for k, v in full_state(model).items()})
    return model, norms, states


@distributed(world_size=2)
@pytest.mark.parametrize("kind", ["norm", "value"])
@pytest.mark.parametrize("plugin", PLUGINS)
def test_plugins_clip_grad_matches_torch_fp32(rank: int, world_size: int, plugin: str, kind: str) -> None:
    batches = data(STEPS)
    expected, ref_norms, _ = _reference(batches, kind)
    model, norms, _ = _run(rank, world_size, plugin, "fp32", kind, batches)
    if kind == "norm":
        assert min(ref_norms) > MAX_NORM, "the test must really clip"
        assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert_matches(model, expected, f"{plugin} clip_grad_by_{kind}")


def _update(states: list[dict[str, torch.Tensor]], step: int, start: dict[str, torch.Tensor]) -> torch.Tensor:
    before = start if step == 0 else states[step - 1]
    return torch.cat([(states[step][k] - before[k]).reshape(-1) for k in sorted(start)])


@distributed(world_size=2)
@pytest.mark.parametrize("kind", ["norm", "value"])
@pytest.mark.parametrize("plugin", PLUGINS)
def test_plugins_clip_grad_unscales_fp16(rank: int, world_size: int, plugin: str, kind: str) -> None:
    batches = data(STEPS)
    start = {k: v.detach().clone() for k, v in GPT(CONFIG, seed=0).state_dict().items()}
    _, ref_norms, ref_states = _reference(batches, kind)
    _, norms, states = _run(rank, world_size, plugin, "fp16", kind, batches)
    if kind == "norm":
        assert norms == pytest.approx(ref_norms, rel=2e-2), "the norm of the true (unscaled) gradients"
    for step in range(STEPS):
        mine, want = _update(states, step, start), _update(ref_states, step, start)
        # the projection on the reference's step and its length: 1 within fp16 rounding; 1/256 when clipped scaled
        assert float(mine @ want / (want @ want)) == pytest.approx(1.0, abs=0.01), f"{plugin} step {step}"
        if kind == "value":
            assert float(mine.abs().max()) <= LR * CLIP_VALUE * 1.05, f"{plugin} step {step}: an unclipped element"


@distributed(world_size=2)
@pytest.mark.parametrize("kind", ["norm", "value"])
@pytest.mark.parametrize("plugin", PLUGINS)
def test_plugins_clip_grad_keeps_fp16_overflow_visible(rank: int, world_size: int, plugin: str, kind: str) -> None:
    """A +inf gradient must still skip the step after clipping (clamping would make it finite and train on it).
    The input 6e4 fits fp16, its gradient times the loss scale does not: one weight gets +inf (no nan)."""
    torch.manual_seed(0)
    options = {} if plugin == "torch_ddp" else {"precision": "fp16", "initial_scale": 2**8}
    booster = Booster(mixed_precision="fp16" if plugin == "torch_ddp" else None, plugin=make_plugin(plugin, **options))
    plain = nn.Linear(4, 1, bias=False)
    model, optimizer, *_ = booster.boost(plain, torch.optim.SGD(plain.parameters(), lr=LR))
    assert optimizer is not None
    before = {k: v.detach().float().clone() for k, v in full_state(model).items()}
    x = torch.tensor([[6e4 if rank == 0 else 1.0, 1.0, 1.0, 1.0]])
    booster.backward(model(x).float().sum(), optimizer)
    _clip(optimizer, [], kind)
    optimizer.step()
    optimizer.zero_grad()
    for name, value in full_state(model).items():
        assert torch.equal(value.float(), before[name]), f"{plugin}: {name} changed although the step overflowed"
