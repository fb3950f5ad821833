"""A boosted transformers model refuses packed documents that its flash-attention path would let attend to each
other.

transformers' flash-attention implementations (`flash_attention_2`, `_3`, kernel-hub flash variants) find packed
documents from restarting `position_ids` only when the batch has one row (`_is_packed_sequence`); with several rows
and no attention mask they run plain causal attention over each whole row, so the documents of a window attend to
each other without a word. sdpa, eager, flex and cx's sequence-parallel attentions build the block-diagonal mask
instead (docs/plugins.md, "Packed documents"). The check reads the positions on the host only under a flash
implementation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["refuse_flash_packing", "refuse_flash_packing_hook"]


def refuse_flash_packing_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if not isinstance(implementation, str) or "flash" not in implementation:
        return
    positions = kwargs.get("position_ids")
    if kwargs.get("attention_mask") is not None or not isinstance(positions, torch.Tensor) or positions.dim() != 2:
        return
    rows, length = positions.shape
    if rows == 1 or length < 2 or not bool((positions.diff(dim=-1) != 1).any()):
        return
    raise ValueError(
        f"{type(module).__name__}: attn_implementation={implementation!r} with restarting position_ids (packed "
        f"documents) in a batch of {rows} rows: transformers' flash attention finds packed documents only in a "
        "batch of one row, so these would attend to each other; use attn_implementation='sdpa' (a block-diagonal "
        "mask) or flatten the windows into one row"
    )


def refuse_flash_packing(model: nn.Module) -> None:
    """Install the check on `model` when it is a transformers model (its config has `_attn_implementation`)."""
    if hasattr(getattr(model, "config", None), "_attn_implementation"):
        model.register_forward_pre_hook(refuse_flash_packing_hook, with_kwargs=True)
