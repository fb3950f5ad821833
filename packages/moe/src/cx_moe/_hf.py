"""Hugging Face transformers 5 MoE blocks made expert-parallel in place.

transformers 5 MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) share one layout: a router at `block.gate`
returning (logits, top-k weights, top-k indices) and fused experts at `block.experts` (`gate_up_proj [E, 2I, H]`,
gate rows first; `down_proj [E, H, I]`; `act_fn`) called as `experts(hidden [T, H], top_k_index, top_k_weights)`.
cx keeps the block, its router (so routing, normalisation, `output_router_logits` and the aux loss stay exactly
transformers') and its shared experts, and changes only the experts module: its two parameters become this rank's
slice (same names, so state dicts keep their keys) and its forward becomes dispatch -> grouped matmul -> combine.

The forward is replaced on the experts instance rather than registered in transformers' `ExpertsInterface`: the
registry is selected per model config (`_experts_implementation`, saved with it) and consulted only by classes
decorated with `use_experts_implementation`, while the instance override works for every block in the table and
leaves the config untouched. Blocks are recognised by class name and then checked structurally, so a transformers
release that changes a layout fails here with `UnknownMoeBlockError` instead of computing something else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, MethodType

import torch
from torch import nn

from cx_mesh import ProcessGroup
from cx_moe._dispatch import combine, dispatch
from cx_moe._experts import expert_mlp
from cx_moe._grad_scale import scale_grad
from cx_moe._groups import check_expert_groups
from cx_moe._marking import MoeParamInfo, set_moe_tensor_info
from cx_moe._options import MoeFp8Options

__all__ = ["HF_MOE_BLOCKS", "UnknownMoeBlockError", "expert_parallelize_hf"]

# block class -> model family; every entry has `gate` (router) and `experts` (fused 3-D experts)
HF_MOE_BLOCKS: Mapping[str, str] = MappingProxyType(
    {
        "MixtralSparseMoeBlock": "mixtral",
        "Qwen2MoeSparseMoeBlock": "qwen2_moe",
        "Qwen3MoeSparseMoeBlock": "qwen3_moe",
        "DeepseekV3MoE": "deepseek_v3",
    }
)


_STATE = "_cx_expert_parallel"  # attribute of a converted experts module


class UnknownMoeBlockError(ValueError):
    """A module looks like a MoE block (it holds stacked experts) but cx does not know its layout."""


@dataclass(frozen=True)
class _ExpertParallelState:
    """What the replaced forward needs: the ep group (None: the experts are whole, converted only for fp8), the
    block's expert count, the ep size and the fp8 switches."""

    group: ProcessGroup | None
    num_experts: int
    ep_size: int
    fp8: MoeFp8Options = field(default_factory=MoeFp8Options)


def _has_stacked_experts(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return isinstance(experts, nn.Module) and any(p.dim() == 3 for p in experts.parameters(recurse=False))


def _check_layout(name: str, block: nn.Module) -> tuple[nn.Module, int]:
    """The block's experts module and expert count, after checking the layout cx relies on."""
    kind = type(block).__name__
    experts, router = getattr(block, "experts", None), getattr(block, "gate", None)
    problems = []
    if not isinstance(experts, nn.Module) or not isinstance(router, nn.Module):
        problems.append("no `experts` and `gate` submodules")
    else:
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        weight = getattr(router, "weight", None)
        if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
            problems.append("experts without `gate_up_proj` / `down_proj` parameters")
        elif gate_up.dim() != 3 or down.dim() != 3:
            problems.append(f"expert tensors of rank {gate_up.dim()} / {down.dim()}, expected 3")
        else:
            count, rows, hidden = gate_up.shape
            if tuple(down.shape) != (count, hidden, rows // 2) or rows % 2:
                problems.append(
                    f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not [E, 2I, H] / "
                    "[E, H, I]"
                )
            if not isinstance(weight, torch.Tensor) or weight.shape[0] != count:
                problems.append("a router whose `weight` is not [num_experts, hidden]")
        for flag, expected in (("has_bias", False), ("is_transposed", False), ("has_gate", True)):
            if getattr(experts, flag, expected) is not expected:
                problems.append(f"experts.{flag} = {not expected}")
        if getattr(experts, "is_concatenated", True) is not True:
            problems.append("interleaved gate/up rows (is_concatenated = False)")
        if not callable(getattr(experts, "act_fn", None)):
            problems.append("no `act_fn` on the experts")
    if problems:
        raise UnknownMoeBlockError(
            f"{name} ({kind}): transformers' layout for this block changed, cx cannot make it expert-parallel: "
            + "; ".join(problems)
        )
    assert isinstance(experts, nn.Module)
    stacked: torch.Tensor = getattr(experts, "gate_up_proj")  # noqa: B009  (checked above; typed access)
    return experts, int(stacked.shape[0])


def _expert_parallel_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts call, expert-parallel: rows to the experts' ranks, grouped matmul, rows back."""
    state: _ExpertParallelState = getattr(self, _STATE)
    gate_up: torch.Tensor = getattr(self, "gate_up_proj")  # noqa: B009  (nn.Module attributes are untyped)
    down: torch.Tensor = getattr(self, "down_proj")  # noqa: B009
    act: Callable[[torch.Tensor], torch.Tensor] = getattr(self, "act_fn")  # noqa: B009
    apply_gate: Callable[[torch.Tensor], torch.Tensor] | None = getattr(self, "_apply_gate", None)
    fp8 = state.fp8
    rows, counts, plan = dispatch(
        hidden_states, top_k_index, state.num_experts, state.group, fp8_communication=fp8.fp8_communication
    )
    out = expert_mlp(
        rows.to(gate_up.dtype),
        counts,
        scale_grad(gate_up, 1.0 / state.ep_size),
        scale_grad(down, 1.0 / state.ep_size),
        act,
        gated=True,
        apply_gate=apply_gate,
        fp8=fp8.matmul if fp8.use_fp8 else None,
    )
    return combine(out, plan, top_k_weights).to(hidden_states.dtype)


def expert_parallelize_hf(
    model: nn.Module, ep_group: ProcessGroup, moe_dp_group: ProcessGroup | None = None
) -> list[str]:
    """Make every MoE block of a transformers 5 model expert-parallel over `ep_group`, in place; returns the
    converted blocks' names. Each rank keeps experts [r * E/ep, (r + 1) * E/ep) of every block under the original
    parameter names, marked with `ep_group` / `moe_dp_group` (see `moe_param_groups`). A stack still on the meta
    device (built lazily) is narrowed in place instead, keeping its identity so its value can be filled later. Raises
    `UnknownMoeBlockError` for a block cx does not know, and `ValueError` when the model has no MoE block or the
    experts do not split over the group."""
    blocks: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__name__ in HF_MOE_BLOCKS:
            blocks.append((name, module))
        elif _has_stacked_experts(module):
            raise UnknownMoeBlockError(
                f"{name or 'the model'} ({type(module).__name__}) holds stacked experts but is not a MoE block cx "
                f"knows; supported blocks: {', '.join(HF_MOE_BLOCKS)}"
            )
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no MoE block cx knows (supported: {', '.join(HF_MOE_BLOCKS)})")
    checked = []
    for name, block in blocks:  # every block checked before any is changed
        state = getattr(getattr(block, "experts", None), _STATE, None)
        if state is not None and state.group is not None:
            raise ValueError(f"{name} is already expert-parallel")
        checked.append(_check_layout(name, block))
    for (name, _), (experts, count) in zip(blocks, checked, strict=True):
        ep_rank, ep_size = check_expert_groups(count, ep_group, moe_dp_group, name)
        local = count // ep_size
        rows = slice(ep_rank * local, (ep_rank + 1) * local)
        info = MoeParamInfo(ep_group, moe_dp_group, ep_rank, ep_size, count)
        for param_name in ("gate_up_proj", "down_proj"):
            full: nn.Parameter = getattr(experts, param_name)
            if full.is_meta:  # built lazily: narrowed in place (no memory), so its value can still be filled later
                full.data = full.data[rows]
                set_moe_tensor_info(full, info)
                continue
            piece = nn.Parameter(full.detach()[rows].clone(), requires_grad=full.requires_grad)
            set_moe_tensor_info(piece, info)
            setattr(experts, param_name, piece)
        before: _ExpertParallelState | None = getattr(experts, _STATE, None)  # set by convert_moe_to_fp8 at ep 1
        fp8 = MoeFp8Options() if before is None else before.fp8
        setattr(experts, _STATE, _ExpertParallelState(ep_group, count, ep_size, fp8))
        setattr(experts, "forward", MethodType(_expert_parallel_forward, experts))  # noqa: B010  (instance override)
    return [name for name, _ in blocks]
