"""Aux-loss-free load balancing (DeepSeek-V3; Megatron's `moe_router_enable_expert_bias`).

Each router with `expert_bias` counts its training-mode assignments in `expert_load`. After the optimizer step,
`update_expert_bias` sums those counts over the data-parallel group (so every replica of a router moves its bias
identically), nudges each expert's bias by `bias_update_rate * sign(mean_load - load)` (underloaded experts up,
overloaded down) and clears the counts. Counts accumulate over every forward between two updates, so with gradient
accumulation the update sees the whole step's tokens, exactly as with one large batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from cx_mesh import ProcessGroup, all_reduce
from cx_moe._router import TopKRouter

__all__ = ["register_expert_bias_update", "update_expert_bias"]


def _routers(module: nn.Module) -> list[TopKRouter]:
    return [m for m in module.modules() if isinstance(m, TopKRouter) and m.expert_bias is not None]


@torch.no_grad()
def update_expert_bias(module: nn.Module, group: ProcessGroup | None = None) -> int:
    """Update every expert bias in `module` from the counts since the last update (one all-reduce over `group`, the
    group holding replicas of the routers: the whole data-parallel group, experts' ep ranks included; None is the
    world when torch.distributed is initialised, else no reduction). Returns how many routers were updated."""
    routers = _routers(module)
    if not routers:
        return 0
    loads = torch.stack([r.expert_load for r in routers if r.expert_load is not None])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        all_reduce(loads, group=group)
    for router, load in zip(routers, loads, strict=True):
        assert router.expert_bias is not None
        assert router.expert_load is not None
        if load.sum() > 0:  # no tokens since the last update: nothing to learn from
            router.expert_bias += router.options.bias_update_rate * torch.sign(load.mean() - load)
        router.expert_load.zero_()
    return len(routers)


def register_expert_bias_update(
    optimizer: torch.optim.Optimizer, module: nn.Module, group: ProcessGroup | None = None
) -> RemovableHandle:
    """Run `update_expert_bias(module, group)` after every `optimizer.step()` (a torch step post-hook; for a
    wrapper such as a ZeRO optimizer pass its inner torch optimizer, whose step the wrapper calls). A skipped step
    (fp16 overflow) calls no inner step, so its counts carry over to the next one."""

    def hook(_optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        update_expert_bias(module, group)

    register: Callable[..., RemovableHandle] = optimizer.register_step_post_hook
    return register(hook)
