"""cx-moe: Mixture-of-Experts building blocks and expert parallelism.

- Routing: `TopKRouter` (`RouterOptions`), `select_experts`, `collect_router_losses`; losses
  `load_balancing_loss` / `pooled_load_balancing_loss` (Switch; transformers' formula) and `router_z_loss`;
  aux-loss-free balancing with `update_expert_bias` / `register_expert_bias_update`.
- Experts: `GroupedExperts` (transformers 5 fused layout, grouped matmul or loop), `expert_mlp`, `grouped_linear`.
- Expert parallelism: `MoeLayer` (`ExpertOptions`, optional `CapacityOptions`), `dispatch` / `combine`
  (dropless uneven all-to-all) and their padded forms.
- Gradient semantics: `is_moe_tensor`, `get_ep_group`, `get_moe_dp_group`, ..., `moe_param_groups` (a
  `pg_to_param_list` for ZeRO).
- Hugging Face: `expert_parallelize_hf` makes a transformers 5 MoE model's blocks expert-parallel in place.
- fp8: `MoeFp8Options` (use_fp8: expert matmuls; fp8_communication: dispatch / combine all-to-alls) on a `MoeLayer`,
  or on every MoE layer of a built model with `convert_moe_to_fp8`.
"""

from cx_moe._balancing import register_expert_bias_update, update_expert_bias
from cx_moe._capacity import expert_capacity, rank_within_expert
from cx_moe._dispatch import DispatchPlan, combine, combine_padded, dispatch, dispatch_padded
from cx_moe._experts import GroupedExperts, expert_mlp, grouped_linear, grouped_mm_supported
from cx_moe._fp8 import convert_moe_to_fp8
from cx_moe._grad_scale import scale_grad
from cx_moe._hf import HF_MOE_BLOCKS, UnknownMoeBlockError, expert_parallelize_hf
from cx_moe._layer import MoeLayer, SharedExpert
from cx_moe._losses import load_balancing_loss, pooled_load_balancing_loss, router_z_loss, tokens_per_expert
from cx_moe._marking import (
    MoeParamInfo,
    get_ep_group,
    get_ep_rank,
    get_ep_size,
    get_moe_dp_group,
    get_moe_info,
    is_moe_tensor,
    moe_param_groups,
    set_moe_tensor_info,
)
from cx_moe._options import (
    Activation,
    CapacityOptions,
    DropPolicy,
    ExpertImplementation,
    ExpertOptions,
    MoeFp8Options,
    RouterOptions,
    ScoreFunction,
)
from cx_moe._router import RouterOutput, TopKRouter, collect_router_losses, select_experts

__all__ = [
    # options
    "Activation",
    "CapacityOptions",
    "DropPolicy",
    "ExpertImplementation",
    "ExpertOptions",
    "MoeFp8Options",
    "RouterOptions",
    "ScoreFunction",
    # routing and load balancing
    "RouterOutput",
    "TopKRouter",
    "collect_router_losses",
    "select_experts",
    "load_balancing_loss",
    "pooled_load_balancing_loss",
    "router_z_loss",
    "tokens_per_expert",
    "register_expert_bias_update",
    "update_expert_bias",
    # experts
    "GroupedExperts",
    "expert_mlp",
    "grouped_linear",
    "grouped_mm_supported",
    # expert parallelism
    "MoeLayer",
    "SharedExpert",
    "DispatchPlan",
    "dispatch",
    "combine",
    "dispatch_padded",
    "combine_padded",
    "expert_capacity",
    "rank_within_expert",
    "scale_grad",
    # parameter marking
    "MoeParamInfo",
    "get_ep_group",
    "get_ep_rank",
    "get_ep_size",
    "get_moe_dp_group",
    "get_moe_info",
    "is_moe_tensor",
    "moe_param_groups",
    "set_moe_tensor_info",
    # Hugging Face
    "HF_MOE_BLOCKS",
    "UnknownMoeBlockError",
    "expert_parallelize_hf",
    # fp8
    "convert_moe_to_fp8",
]
