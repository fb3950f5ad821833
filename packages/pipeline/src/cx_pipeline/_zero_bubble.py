"""`ZeroBubbleVPipeScheduler`: the zero-bubble V schedule (ZB-V, Qi et al. 2024), ColossalAI's class name.

Two chunks per stage in a V: chunk 0 of stage `s` is virtual stage `s`, chunk 1 is `2p - 1 - s`, so stage 0 holds
both the first and the last virtual stage. Each backward is split into an input-gradient pass (I), which the
previous stage waits for, and a weight-gradient pass (W), which nobody waits for and so fills the slots that would
otherwise be bubbles. The order is the zero-bubble paper's hand-built ZB-V order, or for fewer micro-batches than
stages a greedy list schedule, whichever simulates faster (`_zbv_order`); any micro-batch count works.
Each rank runs its list exactly as listed, never reordering a `W` by which messages have arrived: a `W` can run
tp collectives (and ZeRO's reductions), so peers of a tp or dp group must run them in the same order.
The loss lives on stage 0 (it holds the last virtual stage).
"""

from __future__ import annotations

from typing import Any

from cx_pipeline._actions import Action
from cx_pipeline._errors import PipelineConfigError
from cx_pipeline._optimizer import require_split_backward
from cx_pipeline._schedule import PipelineSchedule
from cx_pipeline._stage_manager import PipelineStageManager
from cx_pipeline._zbv_order import zbv_order

__all__ = ["ZeroBubbleVPipeScheduler"]


class ZeroBubbleVPipeScheduler(PipelineSchedule):
    splits_backward = True

    def __init__(
        self,
        stage_manager: PipelineStageManager,
        num_model_chunks: int = 2,
        num_microbatch: int | None = None,
        microbatch_size: int | None = None,
        enable_metadata_cache: bool = True,
        overlap_p2p: bool = True,
        fp8_communication: bool = False,
    ) -> None:
        if num_model_chunks != 2:
            raise PipelineConfigError(
                f"the V schedule has two chunks per stage, got num_model_chunks={num_model_chunks}"
            )
        self.num_model_chunks = num_model_chunks
        super().__init__(
            stage_manager, num_microbatch, microbatch_size, enable_metadata_cache, overlap_p2p, fp8_communication
        )

    def _check_stage_manager(self, manager: PipelineStageManager) -> None:
        if not manager.use_zbv:
            raise PipelineConfigError("ZeroBubbleVPipeScheduler needs a stage manager built with use_zbv=True")

    def _check_optimizer(self, optimizer: Any) -> None:
        super()._check_optimizer(optimizer)
        require_split_backward(optimizer)

    def _orders(self, num_microbatches: int) -> list[list[Action]]:
        return zbv_order(self.stage_manager.num_stages, num_microbatches)
