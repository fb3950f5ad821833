"""`schedule_orders`: a schedule's per-stage action lists by its style name, for `simulate` without a stage manager.

The schedule classes build their lists from a stage manager at run time; a planner that predicts a step before any
process group exists asks here for the same lists (the same functions the classes call), by ColossalAI's `pp_style`.
"""

from __future__ import annotations

from cx_pipeline._actions import Action, interleaved_order, one_f_one_b_order
from cx_pipeline._errors import PipelineConfigError
from cx_pipeline._zbv_order import zbv_order

__all__ = ["SCHEDULE_STYLES", "schedule_orders"]

SCHEDULE_STYLES = ("1f1b", "interleaved", "zbv")


def schedule_orders(
    style: str, num_stages: int, num_microbatches: int, num_model_chunks: int = 1
) -> tuple[list[list[Action]], int]:
    """(per-stage action lists, number of virtual stages) that `style` runs for one step; the pair `simulate`
    takes. Raises `PipelineConfigError` for what the schedule class would refuse."""
    if num_stages < 1 or num_microbatches < 1:
        raise PipelineConfigError(
            f"need num_stages >= 1 and num_microbatches >= 1, got {num_stages} and {num_microbatches}"
        )
    if style == "1f1b":
        if num_model_chunks != 1:
            raise PipelineConfigError(
                f"pp_style '1f1b' holds one chunk per stage, got num_model_chunks={num_model_chunks}"
            )
        return one_f_one_b_order(num_stages, num_microbatches), num_stages
    if style == "interleaved":
        if num_model_chunks < 2:
            raise PipelineConfigError(f"pp_style 'interleaved' needs num_model_chunks >= 2, got {num_model_chunks}")
        if num_microbatches % num_stages:
            raise PipelineConfigError(
                f"pp_style 'interleaved' needs num_microbatches ({num_microbatches}) to be a multiple of the "
                f"{num_stages} stages"
            )
        return interleaved_order(num_stages, num_model_chunks, num_microbatches), num_stages * num_model_chunks
    if style == "zbv":
        if num_model_chunks != 2:
            raise PipelineConfigError(f"pp_style 'zbv' needs num_model_chunks=2 (the V), got {num_model_chunks}")
        return zbv_order(num_stages, num_microbatches), 2 * num_stages
    raise PipelineConfigError(f"unknown pp_style {style!r}; accepted: {', '.join(SCHEDULE_STYLES)}")
