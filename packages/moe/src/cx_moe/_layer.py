"""`MoeLayer`: router, routed experts (split over an expert-parallel group), optional shared expert.

Unsplit (`ep_group=None`) it is an ordinary single-process MoE layer; with an `ep_group` of size n each rank holds
experts [r * E/n, (r + 1) * E/n) and tokens travel by all-to-all (`cx_moe._dispatch`). Built with the same seed, the
split layer's slices equal the unsplit layer's experts, so either can be the other's reference. `MoeFp8Options`
(`fp8=`, or `set_fp8` later) puts the experts' matmuls and the all-to-alls in fp8.
"""

from __future__ import annotations

import torch
from torch import nn

from cx_mesh import ProcessGroup
from cx_mesh.fp8 import Fp8Linear, convert_to_fp8
from cx_moe._capacity import expert_capacity, rank_within_expert
from cx_moe._dispatch import combine, combine_padded, dispatch, dispatch_padded
from cx_moe._experts import GroupedExperts, activation_function
from cx_moe._groups import check_expert_groups
from cx_moe._marking import MoeParamInfo, set_moe_tensor_info
from cx_moe._options import CapacityOptions, ExpertOptions, MoeFp8Options, RouterOptions
from cx_moe._router import TopKRouter

__all__ = ["MoeLayer", "SharedExpert"]


class SharedExpert(nn.Module):
    """An always-on SwiGLU MLP (`gate_proj`, `up_proj`, `down_proj`, the transformers names), optionally scaled
    per token by `sigmoid(gate(x))` (Qwen2-MoE's `shared_expert_gate`)."""

    def __init__(
        self,
        options: ExpertOptions,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        hidden, inner = options.hidden_size, options.shared_intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inner, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(inner, hidden, bias=False, device=device, dtype=dtype)
        self.gate = nn.Linear(hidden, 1, bias=False, device=device, dtype=dtype) if options.shared_expert_gate else None
        self._act = activation_function(options.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))
        if self.gate is not None:
            out = torch.sigmoid(self.gate(x)) * out
        return out


class MoeLayer(nn.Module):
    """Top-k MoE layer over tokens [..., H] -> [..., H] (the residual is the caller's).

    `ep_group` splits the experts over its ranks; `moe_dp_group` is the group of ranks holding the same slice (the
    expert parameters are marked with both, see `moe_param_groups`). `capacity` enables capacity-limited routing
    (dropless without it). `fp8`: fp8 expert matmuls / all-to-alls (`MoeFp8Options`, see `set_fp8`). Router losses:
    `collect_router_losses(model)`.
    """

    def __init__(
        self,
        experts: ExpertOptions,
        router: RouterOptions,
        *,
        capacity: CapacityOptions | None = None,
        ep_group: ProcessGroup | None = None,
        moe_dp_group: ProcessGroup | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        fp8: MoeFp8Options | None = None,
    ) -> None:
        super().__init__()
        self.ep_rank, self.ep_size = check_expert_groups(router.num_experts, ep_group, moe_dp_group, "MoeLayer")
        self.fp8 = MoeFp8Options()
        self.expert_options = experts
        self.router_options = router
        self.capacity = capacity
        self.ep_group = ep_group
        self.num_experts = router.num_experts
        self.gate = TopKRouter(experts.hidden_size, router, device=device, dtype=dtype)
        local = router.num_experts // self.ep_size
        self.experts = GroupedExperts(
            local,
            experts.hidden_size,
            experts.intermediate_size,
            gated=experts.gated,
            activation=experts.act,
            implementation=experts.impl,
            initialize=self.ep_size == 1,
            device=device,
            dtype=dtype,
        )
        if self.ep_size > 1:
            # initialise all experts, keep this rank's slice: the same seed gives the unsplit layer's experts
            full = GroupedExperts(
                router.num_experts,
                experts.hidden_size,
                experts.intermediate_size,
                gated=experts.gated,
                device=device,
                dtype=dtype,
            )
            rows = slice(self.ep_rank * local, (self.ep_rank + 1) * local)
            with torch.no_grad():
                self.experts.up_weight.copy_(full.up_weight[rows])
                self.experts.down_proj.copy_(full.down_proj[rows])
            del full
        self.shared_expert = (
            SharedExpert(experts, device=device, dtype=dtype) if experts.shared_intermediate_size else None
        )
        if ep_group is not None or moe_dp_group is not None:
            info = MoeParamInfo(ep_group, moe_dp_group, self.ep_rank, self.ep_size, router.num_experts)
            for param in self.experts.parameters():
                set_moe_tensor_info(param, info)
        if fp8 is not None:
            self.set_fp8(fp8)

    def set_fp8(self, fp8: MoeFp8Options) -> None:
        """Set the fp8 switches (`MoeFp8Options()` turns them off again): with `use_fp8` the routed experts'
        eligible projections compute in fp8 and the shared expert's eligible linears become `Fp8Linear` (the router
        stays in high precision, as torchtitan's); with `fp8_communication` dispatch and combine exchange fp8 rows
        (refused without an ep group of size > 1)."""
        if fp8.fp8_communication and self.ep_size == 1:
            raise ValueError(
                "MoeLayer(fp8_communication=True): the layer has no expert-parallel group of size > 1, so there is "
                "no all-to-all to compress"
            )
        self.fp8 = fp8
        self.experts.fp8 = fp8.matmul if fp8.use_fp8 else None
        if self.shared_expert is not None:
            if fp8.use_fp8:
                convert_to_fp8(self.shared_expert, fp8.matmul)
            else:  # switched off again: the same class swap back (parameters untouched)
                for module in self.shared_expert.modules():
                    if isinstance(module, Fp8Linear):
                        setattr(module, "__class__", nn.Linear)  # noqa: B010  (a class swap, typed as such)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        routing = self.gate(x)
        out = self.route_to_experts(x, routing.indices, routing.weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.view(shape)

    def route_to_experts(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted output [T, H] for tokens `x [T, H]` and their top-k `indices` / `weights`
        (global expert ids): dispatch, this rank's experts, combine."""
        grad_scale = 1.0 / self.ep_size
        fp8_comm = self.fp8.fp8_communication
        if self.capacity is None:
            rows, counts, plan = dispatch(x, indices, self.num_experts, self.ep_group, fp8_communication=fp8_comm)
            return combine(self.experts(rows, counts, grad_scale), plan, weights)
        capacity = expert_capacity(self.capacity, x.shape[0], indices.shape[1], self.num_experts)
        ranks = rank_within_expert(weights, indices, self.num_experts, self.capacity.policy)
        keep = ranks < capacity
        if self.capacity.pad_to_capacity:
            rows, counts, plan = dispatch_padded(
                x, indices, self.num_experts, self.ep_group, keep, ranks, capacity, fp8_communication=fp8_comm
            )
            return combine_padded(self.experts(rows, counts, grad_scale), plan, weights)
        rows, counts, plan = dispatch(x, indices, self.num_experts, self.ep_group, keep, fp8_communication=fp8_comm)
        return combine(self.experts(rows, counts, grad_scale), plan, weights)
