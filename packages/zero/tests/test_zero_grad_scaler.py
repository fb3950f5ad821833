"""DynamicGradScaler / ConstantGradScaler: growth, backoff, hysteresis with its counter reset, bounds, state."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cx_zero import ConstantGradScaler, DynamicGradScaler


def test_zero_scaler_grows_after_interval_of_clean_steps() -> None:
    scaler = DynamicGradScaler(initial_scale=8, growth_factor=2, growth_interval=3, max_scale=64)
    scales = []
    for _ in range(12):
        scaler.update(False)
        scales.append(scaler.scale)
    assert scales == [8, 8, 16, 16, 16, 32, 32, 32, 64, 64, 64, 64]


def test_zero_scaler_hysteresis_counter_resets_after_backoff() -> None:
    scaler = DynamicGradScaler(initial_scale=1024, backoff_factor=0.5, hysteresis=2, growth_interval=100)
    trace = []
    for _ in range(5):
        scaler.update(True)
        trace.append((scaler.scale, scaler.overflow_count))
    # Every second overflow backs off; the counter restarts at 0 after each backoff (ColossalAI's never does).
    assert trace == [(1024, 1), (512, 0), (512, 1), (256, 0), (256, 1)]


def test_zero_scaler_overflows_need_not_be_consecutive_but_growth_clears_them() -> None:
    scaler = DynamicGradScaler(initial_scale=1024, hysteresis=2, growth_interval=2)
    scaler.update(True)
    scaler.update(False)  # a clean step resets the growth counter only
    assert (scaler.scale, scaler.overflow_count, scaler.growth_step) == (1024, 1, 1)
    scaler.update(True)
    assert scaler.scale == 512
    assert scaler.overflow_count == 0
    scaler.update(True)
    scaler.update(False)
    scaler.update(False)  # growth: scale doubles and the pending overflow is forgotten
    assert (scaler.scale, scaler.overflow_count) == (1024, 0)
    scaler.update(True)
    assert scaler.scale == 1024


def test_zero_scaler_respects_min_scale_and_state_round_trip() -> None:
    scaler = DynamicGradScaler(initial_scale=4, hysteresis=1, min_scale=1)
    for _ in range(5):
        scaler.update(True)
    assert scaler.scale == 1
    other = DynamicGradScaler(initial_scale=4, hysteresis=3)
    scaler.update(False)
    other.load_state_dict(scaler.state_dict())
    assert (other.scale, other.growth_step, other.overflow_count) == (1, 1, 0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.booleans(), max_size=60), st.integers(1, 4), st.integers(1, 5))
def test_zero_scaler_matches_documented_rules(outcomes: list[bool], hysteresis: int, interval: int) -> None:
    scaler = DynamicGradScaler(
        initial_scale=2**10, hysteresis=hysteresis, growth_interval=interval, min_scale=1, max_scale=2**14
    )
    scale, growth, overflows = 2.0**10, 0, 0
    for overflow in outcomes:
        scaler.update(overflow)
        if overflow:
            growth, overflows = 0, overflows + 1
            if overflows >= hysteresis:
                scale, overflows = max(scale / 2, 1), 0
        else:
            growth += 1
            if growth == interval:
                scale, growth, overflows = min(scale * 2, 2**14), 0, 0
        assert (scaler.scale, scaler.growth_step, scaler.overflow_count) == (scale, growth, overflows)


def test_zero_constant_scaler_and_bad_arguments() -> None:
    constant = ConstantGradScaler(128)
    constant.update(True)
    assert constant.scale == 128
    assert constant.inv_scale == 1 / 128
    with pytest.raises(ValueError, match="hysteresis"):
        DynamicGradScaler(hysteresis=0)
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicGradScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match="above max_scale"):
        DynamicGradScaler(initial_scale=2**30, max_scale=2**24)
    with pytest.raises(ValueError, match="initial_scale"):
        ConstantGradScaler(0)
