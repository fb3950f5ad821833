"""`convert_moe_to_fp8`: switch fp8 on for every MoE layer of a built model, in place (the MoE counterpart of
`cx_mesh.fp8.convert_to_fp8`, which converts plain `nn.Linear` layers and cannot see stacked experts).

cx's own `MoeLayer`s get `set_fp8`. A transformers MoE block already made expert-parallel keeps its forward and gets
the switches in its state; a whole one (ep size 1) gets cx's expert forward with no group, which computes the same
experts (dispatch without exchange, the grouped experts, combine) and can run their matmuls in fp8. Blocks whose
name ends in one of `matmul.exclude` keep high-precision matmuls. Nothing is converted before every block is checked.
"""

from __future__ import annotations

import dataclasses
from types import MethodType

from torch import nn

from cx_moe._hf import _STATE, HF_MOE_BLOCKS, _check_layout, _expert_parallel_forward, _ExpertParallelState
from cx_moe._layer import MoeLayer
from cx_moe._options import MoeFp8Options

__all__ = ["convert_moe_to_fp8"]


def _for_block(name: str, fp8: MoeFp8Options) -> MoeFp8Options:
    excluded = any(name.endswith(suffix) or f"{name}.experts".endswith(suffix) for suffix in fp8.matmul.exclude)
    return dataclasses.replace(fp8, use_fp8=False) if excluded else fp8


def convert_moe_to_fp8(model: nn.Module, fp8: MoeFp8Options) -> list[str]:
    """Apply `fp8` to every `MoeLayer` and transformers MoE block (`HF_MOE_BLOCKS`) of `model`; returns their
    names. Raises `ValueError` when the model has no MoE layer, and when `fp8_communication` is asked of a layer
    without an expert-parallel group of size > 1 (it has no all-to-all to compress)."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, MoeLayer)]
    blocks = [(n, m) for n, m in model.named_modules() if type(m).__name__ in HF_MOE_BLOCKS]
    if not layers and not blocks:
        raise ValueError(f"convert_moe_to_fp8: {type(model).__name__} has no MoeLayer or MoE block cx knows")
    checked: list[tuple[str, nn.Module, int, _ExpertParallelState | None, int]] = []
    for name, block in blocks:
        converted = getattr(block, "experts", None)
        state: _ExpertParallelState | None = getattr(converted, _STATE, None)
        if state is None or not isinstance(converted, nn.Module):  # whole: check the layout cx's forward relies on
            experts, count = _check_layout(name, block)
            checked.append((name, experts, count, None, 1))
        else:  # already expert-parallel (checked then; its stacks now hold this rank's slice only)
            checked.append((name, converted, state.num_experts, state, state.ep_size))
    for name, ep_size in [(n, m.ep_size) for n, m in layers] + [(c[0], c[4]) for c in checked]:
        if fp8.fp8_communication and ep_size == 1:
            raise ValueError(
                f"convert_moe_to_fp8(fp8_communication=True): {name or 'the model'} is not expert-parallel (ep size "
                "1), so it has no all-to-all to compress"
            )
    for name, layer in layers:
        layer.set_fp8(_for_block(name, fp8))
    for name, experts, count, state, _ in checked:
        mine = _for_block(name, fp8)
        if state is None:
            setattr(experts, _STATE, _ExpertParallelState(None, count, 1, mine))
            setattr(experts, "forward", MethodType(_expert_parallel_forward, experts))  # noqa: B010
        else:
            setattr(experts, _STATE, dataclasses.replace(state, fp8=mine))
    return [name for name, _ in layers] + [name for name, *_ in checked]
