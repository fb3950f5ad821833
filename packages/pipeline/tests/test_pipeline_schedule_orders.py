"""`schedule_orders`: the public, stage-manager-free way to the action lists each pp_style runs (for planners)."""

from __future__ import annotations

import pytest

from cx_pipeline import PipelineConfigError, schedule_orders, simulate


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8)])
def test_schedule_orders_simulate_each_style(p: int, m: int) -> None:
    orders, virtual = schedule_orders("1f1b", p, m)
    assert virtual == p
    assert simulate(orders, virtual).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))  # the textbook bubble
    interleaved, virtual = schedule_orders("interleaved", p, m, num_model_chunks=2)
    assert virtual == 2 * p
    # unit-time actions: each chunk is half a stage, so scale the bubble by comparing makespans in whole-stage units
    assert simulate(interleaved, virtual).makespan / 2 < simulate(orders, p).makespan
    zbv, virtual = schedule_orders("zbv", p, m, num_model_chunks=2)
    assert sorted(simulate(zbv, virtual).busy) == [6 * m] * p  # F, I and W of both chunks, once each


def test_schedule_orders_refuse_what_the_schedules_refuse() -> None:
    with pytest.raises(PipelineConfigError, match="multiple of the 4 stages"):
        schedule_orders("interleaved", 4, 6, num_model_chunks=2)
    with pytest.raises(PipelineConfigError, match="num_model_chunks=2"):
        schedule_orders("zbv", 2, 4, num_model_chunks=3)
    with pytest.raises(PipelineConfigError, match="one chunk per stage"):
        schedule_orders("1f1b", 2, 4, num_model_chunks=2)
    with pytest.raises(PipelineConfigError, match="unknown pp_style 'gpipe'"):
        schedule_orders("gpipe", 2, 4)
