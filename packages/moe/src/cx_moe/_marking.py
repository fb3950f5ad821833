"""Marking expert parameters with their process groups, so that data-parallel machinery reduces them correctly
without knowing about MoE.

An expert parameter holds this rank's slice of `num_experts` experts along dim 0 (ep rank r holds
[r * E_local, (r + 1) * E_local)); its gradient is reduced over its moe-dp group (the ranks holding the same slice),
while dense parameters are reduced over the whole data-parallel group. `moe_param_groups` turns that into the
`pg_to_param_list` mapping cx-zero's `LowLevelZeroOptimizer` (and ColossalAI's) accept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import ProcessGroup

__all__ = [
    "MoeParamInfo",
    "get_ep_group",
    "get_ep_rank",
    "get_ep_size",
    "get_moe_dp_group",
    "get_moe_info",
    "is_moe_tensor",
    "moe_param_groups",
    "set_moe_tensor_info",
]

_ATTRIBUTE = "_cx_moe_info"


@dataclass(frozen=True)
class MoeParamInfo:
    """Where an expert parameter's slice sits: `ep_group` (None: not split), `moe_dp_group` (the ranks holding the
    same slice, over which its gradient is averaged; None: not given), this rank's `ep_rank` of `ep_size`, and the
    full count `num_experts` along dim 0."""

    ep_group: ProcessGroup | None
    moe_dp_group: ProcessGroup | None
    ep_rank: int
    ep_size: int
    num_experts: int

    @property
    def local_experts(self) -> range:
        """The global expert ids this rank holds."""
        per_rank = self.num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)


def set_moe_tensor_info(param: torch.Tensor, info: MoeParamInfo) -> None:
    """Mark `param` as an expert parameter (the mark travels with the Parameter object)."""
    setattr(param, _ATTRIBUTE, info)


def get_moe_info(param: torch.Tensor) -> MoeParamInfo | None:
    info = getattr(param, _ATTRIBUTE, None)
    return info if isinstance(info, MoeParamInfo) else None


def is_moe_tensor(param: torch.Tensor) -> bool:
    """Whether `param` holds experts (as ColossalAI's `is_moe_tensor`)."""
    return get_moe_info(param) is not None


def _require(param: torch.Tensor) -> MoeParamInfo:
    info = get_moe_info(param)
    if info is None:
        raise ValueError(f"not an expert parameter (shape {tuple(param.shape)}): check is_moe_tensor first")
    return info


def get_ep_group(param: torch.Tensor) -> ProcessGroup | None:
    return _require(param).ep_group


def get_moe_dp_group(param: torch.Tensor) -> ProcessGroup | None:
    return _require(param).moe_dp_group


def get_ep_size(param: torch.Tensor) -> int:
    return _require(param).ep_size


def get_ep_rank(param: torch.Tensor) -> int:
    return _require(param).ep_rank


def moe_param_groups(
    params: nn.Module | Iterable[nn.Parameter], dp_group: ProcessGroup | None = None
) -> dict[ProcessGroup, list[nn.Parameter]]:
    """`pg_to_param_list` for a ZeRO optimizer: dense parameters under `dp_group` (default: the world), expert
    parameters under their moe-dp group. Every expert parameter must name the same moe-dp group (one expert layout
    per model); a group with no trainable parameters is still listed (empty), so the dense group keeps spanning
    the others."""
    items = list(params.parameters()) if isinstance(params, nn.Module) else list(params)
    dense_group = dp_group if dp_group is not None else dist.group.WORLD
    if dense_group is None:
        raise RuntimeError("moe_param_groups needs torch.distributed to be initialised (or an explicit dp_group)")
    dense = [p for p in items if not is_moe_tensor(p)]
    experts = [p for p in items if is_moe_tensor(p)]
    groups = {get_moe_dp_group(p) for p in experts}
    if len(groups) > 1:
        raise ValueError("expert parameters name different moe-dp groups: give moe_param_groups one expert layout")
    result: dict[ProcessGroup, list[nn.Parameter]] = {dense_group: dense}
    if experts:
        moe_dp = groups.pop()
        if moe_dp is None:
            raise ValueError("expert parameters carry no moe-dp group: build the MoE layers with moe_dp_group")
        if moe_dp in result:
            result[moe_dp] = result[moe_dp] + experts
        else:
            result[moe_dp] = experts
    return result
