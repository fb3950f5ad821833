"""ColossalAI's learning-rate schedulers in cx: each curve against its formula written out here step by step,
against torch's own scheduler where one exists, and a state_dict round trip that resumes mid-curve."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cx_checkpoint import GeneralCheckpointIO
from cx_plugins import lr_scheduler as cx_lr

BASE = 0.1
TOTAL, WARMUP = 20, 4


def _optimizer(lr: float = BASE) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _rates(make: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler], steps: int) -> list[float]:
    optimizer = _optimizer()
    scheduler = make(optimizer)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def _cosine(base: float, floor: float, done: int, length: int) -> float:
    return floor + (base - floor) * (1 + math.cos(math.pi * done / length)) / 2


def _expected_cosine_warmup(step: int, eta_min: float) -> float:
    if step < WARMUP:
        return BASE * (step + 1) / WARMUP
    return _cosine(BASE, eta_min, step - WARMUP, TOTAL - WARMUP)


def _expected_linear_warmup(step: int) -> float:
    if step < WARMUP:
        return BASE * (step + 1) / (WARMUP + 1)
    return BASE * (TOTAL - step) / (TOTAL - WARMUP)


def _expected_flat_warmup(step: int) -> float:
    flat = int((TOTAL - WARMUP) * 0.5)
    if step < WARMUP:
        return BASE * (step + 1) / WARMUP
    if step < WARMUP + flat:
        return BASE
    return _cosine(BASE, 0.01, step - WARMUP - flat, TOTAL - WARMUP - flat)


def _expected_poly_warmup(step: int) -> float:
    if step < WARMUP:
        return BASE * (step + 1) / WARMUP
    return (BASE - 0.001) * (1 - (step - WARMUP) / (TOTAL - WARMUP)) ** 2 + 0.001


def _expected_multistep_warmup(step: int) -> float:
    if step < WARMUP:
        return BASE * (step + 1) / WARMUP
    return BASE * 0.5 ** sum(step >= m for m in (8, 14))


CURVES = {
    "cosine_warmup": (
        lambda o: cx_lr.CosineAnnealingWarmupLR(o, TOTAL, warmup_steps=WARMUP, eta_min=0.01),
        lambda s: _expected_cosine_warmup(s, 0.01),
    ),
    "linear_warmup": (lambda o: cx_lr.LinearWarmupLR(o, TOTAL, warmup_steps=WARMUP), _expected_linear_warmup),
    "flat_annealing_warmup": (
        lambda o: cx_lr.FlatAnnealingWarmupLR(o, TOTAL, warmup_steps=WARMUP, pct_start=0.5, eta_min=0.01),
        _expected_flat_warmup,
    ),
    "flat_annealing": (
        lambda o: cx_lr.FlatAnnealingLR(o, TOTAL, pct_start=0.25),
        lambda s: BASE if s < 5 else _cosine(BASE, 0.0, s - 5, TOTAL - 5),
    ),
    "polynomial_warmup": (
        lambda o: cx_lr.PolynomialWarmupLR(o, TOTAL, warmup_steps=WARMUP, end_lr=0.001, power=2.0),
        _expected_poly_warmup,
    ),
    "polynomial": (
        lambda o: cx_lr.PolynomialLR(o, TOTAL, end_lr=0.001, power=1.0),
        lambda s: (BASE - 0.001) * (1 - s / TOTAL) + 0.001,
    ),
    "multistep_warmup": (
        lambda o: cx_lr.MultiStepWarmupLR(o, TOTAL, warmup_steps=WARMUP, milestones=[8, 14], gamma=0.5),
        _expected_multistep_warmup,
    ),
}


@pytest.mark.parametrize("name", sorted(CURVES))
def test_lr_scheduler_curve_matches_its_formula(name: str) -> None:
    make, expected = CURVES[name]
    rates = _rates(make, TOTAL)
    assert rates == pytest.approx([expected(s) for s in range(TOTAL)], rel=1e-9, abs=1e-12)


TORCH_EQUIVALENTS = {
    "cosine": (
        lambda o: cx_lr.CosineAnnealingLR(o, TOTAL, eta_min=0.01),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, TOTAL, eta_min=0.01),
    ),
    "multistep": (
        lambda o: cx_lr.MultiStepLR(o, TOTAL, milestones=[5, 9], gamma=0.3),
        lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [5, 9], gamma=0.3),
    ),
    "onecycle": (
        lambda o: cx_lr.OneCycleLR(o, TOTAL, pct_start=0.25),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, BASE, total_steps=TOTAL, pct_start=0.25),
    ),
    "step": (
        lambda o: cx_lr.StepLR(o, TOTAL, step_size=3, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.5),
    ),
    "exponential": (
        lambda o: cx_lr.ExponentialLR(o, TOTAL, gamma=0.9),
        lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9),
    ),
    "lambda": (
        lambda o: cx_lr.LambdaLR(o, TOTAL, lr_lambda=lambda s: 1 / (s + 1)),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)),
    ),
    "multiplicative": (
        lambda o: cx_lr.MultiplicativeLR(o, TOTAL, lr_lambda=lambda s: 0.95),
        lambda o: torch.optim.lr_scheduler.MultiplicativeLR(o, lambda s: 0.95),
    ),
}


@pytest.mark.parametrize("name", sorted(TORCH_EQUIVALENTS))
def test_lr_scheduler_matches_torch(name: str) -> None:
    ours, theirs = TORCH_EQUIVALENTS[name]
    assert _rates(ours, TOTAL) == pytest.approx(_rates(theirs, TOTAL), rel=1e-12)


@pytest.mark.parametrize("name", sorted(CURVES))
def test_lr_scheduler_state_dict_resumes_mid_curve(name: str) -> None:
    make, _ = CURVES[name]
    uninterrupted = _rates(make, TOTAL)
    optimizer = _optimizer()
    scheduler = make(optimizer)
    for _ in range(7):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    # a fresh optimizer (rate reset to the base) and scheduler continue from the saved step
    resumed_optimizer = _optimizer()
    resumed = make(resumed_optimizer)
    resumed.load_state_dict(state)
    for group, last in zip(resumed_optimizer.param_groups, resumed.get_last_lr(), strict=True):
        group["lr"] = last
    rates = []
    for _ in range(7, TOTAL):
        rates.append(resumed_optimizer.param_groups[0]["lr"])
        resumed_optimizer.step()
        resumed.step()
    assert rates == pytest.approx(uninterrupted[7:], rel=1e-9, abs=1e-12)


def test_lr_scheduler_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="warmup_steps must be in"):
        cx_lr.CosineAnnealingWarmupLR(_optimizer(), 10, warmup_steps=11)
    with pytest.raises(ValueError, match="total_steps must be at least 1"):
        cx_lr.PolynomialLR(_optimizer(), 0)
    with pytest.raises(ValueError, match="pct_start"):
        cx_lr.FlatAnnealingLR(_optimizer(), 10, pct_start=1.5)
    with pytest.raises(ValueError, match="milestones"):
        cx_lr.MultiStepWarmupLR(_optimizer(), 10, warmup_steps=2)
    with pytest.raises(ValueError, match="anneal_strategy"):
        cx_lr.OneCycleLR(_optimizer(), 10, anneal_strategy="exp")


def test_version_is_the_installed_distributions() -> None:
    from importlib import metadata

    import cx_plugins

    assert cx_plugins.__version__ == metadata.version("cx-plugins")


@pytest.mark.parametrize("name", sorted(CURVES))
def test_lr_scheduler_state_survives_a_cx_checkpoint(name: str, tmp_path: Path) -> None:
    """A scheduler's state is plain data: cx's checkpoint IO stores it as JSON and a rebuilt scheduler resumes."""
    make, expected = CURVES[name]
    optimizer = _optimizer()
    scheduler = make(optimizer)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    GeneralCheckpointIO().save_lr_scheduler(scheduler, tmp_path / "scheduler.json")
    resumed_optimizer = _optimizer()
    resumed = make(resumed_optimizer)
    GeneralCheckpointIO().load_lr_scheduler(resumed, tmp_path / "scheduler.json")
    assert resumed.last_epoch == 5
    assert resumed.get_last_lr() == pytest.approx([expected(5)], rel=1e-9, abs=1e-12)
