"""cx-zero: ZeRO data parallelism for cx.

- `GeminiDDP` / `GeminiOptimizer`: chunk-based ZeRO-3 with GPU/CPU placement (cx-chunk), in `cx_zero.gemini`,
  re-exported here with `GeminiOptions`, `GeminiOptimizerOptions`, `PlacementKind`, `PathMismatchError` and the
  whole-tensor seam (`GeminiWholeStep`, `WholeParam`, `SplitWholeStates`).
- `LowLevelZeroOptimizer`: ZeRO-1/2 (master weights, optimizer state and, with stage 2, gradients partitioned) over
  one or several data-parallel groups (dense over the full DP group, MoE experts over a smaller one).
- Option groups, each defined once and taken whole by the engines (`options=`, instead of ColossalAI's flat
  keywords, which the constructors keep): `LossScaleOptions`, `ClipOptions`, `LowLevelZeroOptions`, `GeminiOptions`,
  `GeminiOptimizerOptions`; `Precision`, the one spelling of a training precision (name or dtype, one `parse`).
- Shared with Gemini: `DynamicGradScaler` / `ConstantGradScaler` (loss scaling), `compute_grad_norm` /
  `clip_grad_norm_` (norm over exactly the given groups), `has_inf_or_nan` / `any_across_groups` (overflow),
  `HybridAdam` / `CPUAdam` / `FusedAdam` (fused Adam(W), fast on CPU shards), `require_elementwise` (which
  optimizers may step on flat shards), `needs_whole_tensors` / `declare_whole_tensor` (optimizers such as torch's
  Muon that must step each parameter whole), `elementwise_groups` / `GroupKinds` (which param groups of a mixed
  one, such as MuonWithAdamW's AdamW groups, may still step on flat shards), `assign_owners` (which rank steps
  each) and `gather_to_owner` / `scatter_from_owner` (whole tensors between their owner and the ranks holding flat
  pieces of them);
  `MuonWithAdamW` / `muon_param_groups` (Muon on hidden matrices, AdamW on 1-D parameters, embeddings and the output
  head, in one whole-tensor optimizer whose AdamW groups ZeRO steps on its shards).
"""

from cx_zero._adam import CPUAdam, HybridAdam
from cx_zero._bf16_states import BF16_STATE_OPTIMIZERS, Bf16StateAdam, stochastic_round_bf16
from cx_zero._clipping import ClipOptions
from cx_zero._elementwise import (
    ELEMENTWISE_OPTIMIZERS,
    WHOLE_TENSOR_OPTIMIZERS,
    GroupKinds,
    declare_whole_tensor,
    elementwise_groups,
    is_elementwise,
    needs_whole_tensors,
    require_elementwise,
    require_elementwise_or_whole,
)
from cx_zero._fused_adam import FusedAdam
from cx_zero._grad_scaler import BaseGradScaler, ConstantGradScaler, DynamicGradScaler
from cx_zero._loss_scale import LossScaleOptions
from cx_zero._low_level_optimizer import LowLevelZeroOptimizer
from cx_zero._muon_adamw import MUON_DEFAULTS, MuonUpdate, MuonWithAdamW, muon_param_groups
from cx_zero._norm import NormType, clip_coefficient, clip_grad_norm_, compute_grad_norm, local_norm_term, reduce_norm
from cx_zero._options import LowLevelZeroOptions, ZeroStage, parse_states_dtype
from cx_zero._overflow import any_across_groups, has_inf_or_nan
from cx_zero._owners import assign_owners, update_cost
from cx_zero._precision import Precision
from cx_zero._whole_comm import Spans, gather_to_owner, scatter_from_owner
from cx_zero._whole_state import broadcast_state
from cx_zero.gemini import (
    GeminiDDP,
    GeminiOptimizer,
    GeminiOptimizerOptions,
    GeminiOptions,
    GeminiWholeStep,
    ParameterSource,
    PathMismatchError,
    PlacementKind,
    SplitWholeStates,
    WholeParam,
)

__all__ = [
    # Gemini ZeRO-3
    "GeminiDDP",
    "GeminiOptimizer",
    "GeminiOptimizerOptions",
    "GeminiOptions",
    "GeminiWholeStep",
    "ParameterSource",
    "PathMismatchError",
    "PlacementKind",
    "SplitWholeStates",
    "WholeParam",
    # ZeRO-1/2
    "LowLevelZeroOptimizer",
    "LowLevelZeroOptions",
    "ZeroStage",
    "parse_states_dtype",
    # option groups shared by the engines
    "ClipOptions",
    "LossScaleOptions",
    "Precision",
    # loss scaling and overflow
    "BaseGradScaler",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "any_across_groups",
    "has_inf_or_nan",
    # norms and clipping
    "NormType",
    "clip_coefficient",
    "clip_grad_norm_",
    "compute_grad_norm",
    "local_norm_term",
    "reduce_norm",
    # optimizers
    "CPUAdam",
    "FusedAdam",
    "HybridAdam",
    "ELEMENTWISE_OPTIMIZERS",
    "WHOLE_TENSOR_OPTIMIZERS",
    "declare_whole_tensor",
    "GroupKinds",
    "elementwise_groups",
    "MUON_DEFAULTS",
    "MuonUpdate",
    "MuonWithAdamW",
    "muon_param_groups",
    "is_elementwise",
    "needs_whole_tensors",
    "require_elementwise",
    "require_elementwise_or_whole",
    "BF16_STATE_OPTIMIZERS",
    "Bf16StateAdam",
    "stochastic_round_bf16",
    "assign_owners",
    "broadcast_state",
    "update_cost",
    "Spans",
    "gather_to_owner",
    "scatter_from_owner",
]
