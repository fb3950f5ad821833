"""`OneForwardOneBackwardSchedule`: ColossalAI's 1F1B (PipeDream-flush), one model chunk per stage.

Stage `s` warms up with `p - s - 1` forwards, then alternates one forward and one backward, then drains the
remaining backwards: at most `p - s` micro-batches' activations are alive at once. Any micro-batch count works
(fewer than the stages only leaves a larger bubble).
"""

from __future__ import annotations

from cx_pipeline._actions import Action, one_f_one_b_order
from cx_pipeline._errors import PipelineConfigError
from cx_pipeline._schedule import PipelineSchedule
from cx_pipeline._stage_manager import PipelineStageManager

__all__ = ["OneForwardOneBackwardSchedule"]


class OneForwardOneBackwardSchedule(PipelineSchedule):
    def __init__(
        self,
        stage_manager: PipelineStageManager,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        enable_metadata_cache: bool = True,
        overlap_p2p: bool = True,
        fp8_communication: bool = False,
    ) -> None:
        super().__init__(
            stage_manager, num_microbatches, microbatch_size, enable_metadata_cache, overlap_p2p, fp8_communication
        )

    def _check_stage_manager(self, manager: PipelineStageManager) -> None:
        if manager.is_interleave or manager.num_model_chunks != 1:
            raise PipelineConfigError(
                "OneForwardOneBackwardSchedule runs one chunk per stage; this stage manager is interleaved "
                f"(num_model_chunks={manager.num_model_chunks}): use InterleavedSchedule or ZeroBubbleVPipeScheduler"
            )

    def _orders(self, num_microbatches: int) -> list[list[Action]]:
        return one_f_one_b_order(self.stage_manager.num_stages, num_microbatches)
