"""Tensor parallelism inside the stacked experts of transformers 5's MoE blocks (an MoE policy's
`expert_tensor_parallel=True`).

Every expert's intermediate dimension is split over the TP group, in place and with a `ShardSpec`: `gate_up_proj
[E, 2I, H]` keeps its gate rows and its up rows of this rank (parts (I, I) along dim 1, as a fused gate-up column
layer), `down_proj [E, H, I]` its columns of I (dim 2, as a row layer). Each rank's experts then produce a partial
sum of the output, which a forward hook all-reduces over tp; a pre-hook makes the backward all-reduce the gradients
of the experts' two differentiable inputs (the token rows and the routing weights), whose local gradients are only
this rank's share. This wraps the experts' call, so it composes with cx-moe's expert-parallel forward (dispatch and
combine over the ep group run inside, between the hooks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cx_mesh import ProcessGroup
from cx_moe import HF_MOE_BLOCKS
from cx_shardformer._comm import copy_to_parallel, group_size, reduce_forward
from cx_shardformer._shard_spec import make_spec, shard_parameter_

__all__ = ["check_expert_tensor_parallel", "shard_experts_tensor_parallel"]


def _stacked_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None) if type(module).__name__ in HF_MOE_BLOCKS else None
        if isinstance(experts, nn.Module):
            found.append((f"{name}.experts", experts))
    return found


def check_expert_tensor_parallel(model: nn.Module, tp: int) -> None:
    """Raise before anything changes when an experts module has an unexpected layout or its intermediate size does
    not divide by tp."""
    for name, experts in _stacked_experts(model):
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter) or gate_up.dim() != 3:
            raise TypeError(f"{type(model).__name__}: {name} has no stacked gate_up_proj / down_proj to split over tp")
        intermediate = down.shape[2]
        if gate_up.shape[1] != 2 * intermediate or intermediate % tp:
            raise ValueError(
                f"{type(model).__name__}: {name} intermediate size {intermediate} (gate_up_proj "
                f"{tuple(gate_up.shape)}) does not split over the tensor parallel size {tp}"
            )


def shard_experts_tensor_parallel(model: nn.Module, group: ProcessGroup | None) -> int:
    """Split every MoE block's experts over `group` (see the module docstring); returns how many were split."""
    tp = group_size(group)
    check_expert_tensor_parallel(model, tp)
    found = _stacked_experts(model)
    for name, experts in found:
        intermediate = int(getattr(experts, "down_proj").shape[2])  # noqa: B009  (nn.Module attributes are untyped)
        what = f"{name} (experts)"
        shard_parameter_(getattr(experts, "gate_up_proj"), make_spec(1, (intermediate,) * 2, tp, None, what), group)  # noqa: B009
        shard_parameter_(getattr(experts, "down_proj"), make_spec(2, (intermediate,), tp, None, what), group)  # noqa: B009
        _install_hooks(experts, group)
    return len(found)


def _install_hooks(experts: nn.Module, group: ProcessGroup | None) -> None:
    def reduced(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return copy_to_parallel(value, group)
        return value

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        # transformers' call: experts(hidden_states, top_k_index, top_k_weights), positionally or by name
        positional = [reduced(a) if i in (0, 2) else a for i, a in enumerate(args)]
        named = {k: reduced(v) if k in ("hidden_states", "top_k_weights") else v for k, v in kwargs.items()}
        return tuple(positional), named

    def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"expert tensor parallelism: {type(module).__name__} returned {type(output).__name__}")
        return reduce_forward(output, group)

    experts.register_forward_pre_hook(before, with_kwargs=True)
    experts.register_forward_hook(after, with_kwargs=True)
