"""`InterleavedSchedule`: ColossalAI's (Megatron's) interleaved 1F1B over virtual stages.

Each stage holds `num_model_chunks` chunks; chunk `c` of stage `s` is virtual stage `c * p + s`, so activations go
round the ring of stages `num_model_chunks` times. Micro-batches move through the chunks in groups of `p`, which is
why their count must be a multiple of the number of stages. The bubble shrinks by the number of chunks, for
`num_model_chunks` times as many transfers.
"""

from __future__ import annotations

from cx_pipeline._actions import Action, interleaved_order
from cx_pipeline._errors import PipelineConfigError
from cx_pipeline._schedule import PipelineSchedule
from cx_pipeline._stage_manager import PipelineStageManager

__all__ = ["InterleavedSchedule"]


class InterleavedSchedule(PipelineSchedule):
    def __init__(
        self,
        stage_manager: PipelineStageManager,
        num_model_chunks: int,
        num_microbatch: int | None = None,
        microbatch_size: int | None = None,
        enable_metadata_cache: bool = True,
        overlap_p2p: bool = True,
        fp8_communication: bool = False,
    ) -> None:
        if num_model_chunks != stage_manager.num_model_chunks:
            raise PipelineConfigError(
                f"InterleavedSchedule(num_model_chunks={num_model_chunks}) does not match the stage manager's "
                f"num_model_chunks={stage_manager.num_model_chunks}"
            )
        self.num_model_chunks = num_model_chunks
        super().__init__(
            stage_manager, num_microbatch, microbatch_size, enable_metadata_cache, overlap_p2p, fp8_communication
        )

    def _check_stage_manager(self, manager: PipelineStageManager) -> None:
        if not manager.is_interleave or manager.use_zbv:
            raise PipelineConfigError(
                "InterleavedSchedule needs a stage manager built with enable_interleave=True (and use_zbv=False)"
            )

    def _check_microbatches(self, num_microbatches: int) -> None:
        p = self.stage_manager.num_stages
        if num_microbatches % p != 0:
            below = (num_microbatches // p) * p
            options = ", ".join(str(n) for n in (below, below + p) if n > 0)
            raise PipelineConfigError(
                f"InterleavedSchedule needs the number of micro-batches to be a multiple of the {p} pipeline stages, "
                f"got {num_microbatches}; use e.g. {options}"
            )

    def _orders(self, num_microbatches: int) -> list[list[Action]]:
        manager = self.stage_manager
        return interleaved_order(manager.num_stages, manager.num_model_chunks, num_microbatches)
