"""cx-pipeline: the pipeline axis of cx's hybrid plugins.

- `PipelineStageManager`: this rank's stage, neighbours, pipeline group and the layer distribution (even, given,
  or balanced by cost: `balance_layers`, `layer_costs`, `balanced_layers`).
- Schedules with ColossalAI's names and `forward_backward_step`: `OneForwardOneBackwardSchedule`,
  `InterleavedSchedule`, `ZeroBubbleVPipeScheduler` (zero-bubble V, split backward).
- Splitting models into stages: `PipelineSplittable` (the protocol a model implements), `split_model`, the
  transformers adapters `HFDecoderSplitter` (Llama-style decoders, MoE included) and `GPT2Splitter`, and
  `PipelineModel` with parameters tied across stages.
- Micro-batch helpers `split_batch` / `merge_microbatches`, and the schedule simulator `simulate` over the action
  lists `schedule_orders` gives for a `pp_style` (no stage manager needed: what a planner predicts with).
"""

from cx_pipeline._actions import Action, ActionKind
from cx_pipeline._balance import LayerCosts, balanced_layers, layer_costs
from cx_pipeline._errors import EmptyDataIterError, PipelineConfigError
from cx_pipeline._hf import GPT2Splitter, HFDecoderSplitter
from cx_pipeline._interleaved import InterleavedSchedule
from cx_pipeline._microbatch import merge_microbatches, split_batch
from cx_pipeline._model import PipelineModel, SharedParameter
from cx_pipeline._one_f_one_b import OneForwardOneBackwardSchedule
from cx_pipeline._optimizer import PipelineOptimizer
from cx_pipeline._orders import SCHEDULE_STYLES, schedule_orders
from cx_pipeline._schedule import PipelineSchedule
from cx_pipeline._simulation import SimulationResult, simulate
from cx_pipeline._splitting import PipelineSplittable, split_model
from cx_pipeline._stage_manager import PipelineStageManager
from cx_pipeline._zero_bubble import ZeroBubbleVPipeScheduler

__all__ = [
    # stages
    "PipelineStageManager",
    "LayerCosts",
    "layer_costs",
    "balanced_layers",
    "EmptyDataIterError",
    "PipelineConfigError",
    # schedules
    "PipelineSchedule",
    "OneForwardOneBackwardSchedule",
    "InterleavedSchedule",
    "ZeroBubbleVPipeScheduler",
    "PipelineOptimizer",
    "Action",
    "ActionKind",
    "SimulationResult",
    "simulate",
    "schedule_orders",
    "SCHEDULE_STYLES",
    # models
    "PipelineSplittable",
    "split_model",
    "HFDecoderSplitter",
    "GPT2Splitter",
    "PipelineModel",
    "SharedParameter",
    # batches
    "split_batch",
    "merge_microbatches",
]
