"""Activation checkpointing of a whole model through its own switch, every decoder layer either recomputed in full
or under the selective op policy torchtitan runs (`selective_ac_option = "op"`).

The selective policy saves, inside each checkpointed layer, the outputs of the ops that are costly to recompute and
recomputes the rest (norms, activations functions, element-wise ops, RoPE): every other matrix multiply (the 1st,
3rd, ... of the layer's forward, counted separately when the backward recomputes it, so both passes decide alike),
the attention kernels (flash / efficient / cuDNN / CPU flash SDPA), functional reduce-scatters, and `max`. cx counts
`addmm` (a linear with bias) as a matrix multiply too; torchtitan's Llama has no biases, so there the rule is the
same. It runs through `torch.utils.checkpoint.create_selective_checkpoint_contexts`, handed to the non-reentrant
checkpoint as its `context_fn` by transformers' `gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`.
The hybrid plugins checkpoint through ShardFormer's policies (a ratio of whole layers), which do not take it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["CHECKPOINT_MODES", "SelectiveOpPolicy", "enable_activation_checkpointing", "selective_op_context"]

CHECKPOINT_MODES = ("full", "selective-op")
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
_ALWAYS_SAVED = (
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
)


class SelectiveOpPolicy:
    """torchtitan's op policy for one checkpointed call: save the listed ops' outputs and every other matmul's."""

    def __init__(self) -> None:
        self.matmuls = {"forward": 0, "recompute": 0}

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in _MATMULS:
            key = "recompute" if ctx.is_recompute else "forward"
            self.matmuls[key] += 1
            saved = self.matmuls[key] % 2 == 1
        else:
            saved = func in _ALWAYS_SAVED
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def selective_op_context() -> tuple[Any, Any]:
    """A fresh policy's (forward, recompute) contexts: `context_fn` for `torch.utils.checkpoint.checkpoint`."""
    contexts: tuple[Any, Any] = create_selective_checkpoint_contexts(SelectiveOpPolicy())
    return contexts


def enable_activation_checkpointing(model: nn.Module, mode: str = "full") -> None:
    """Checkpoint every decoder layer of `model` through its own switch (transformers' `gradient_checkpointing_enable`
    or its newer `activation_checkpointing_enable`), non-reentrant; `mode` "selective-op" adds the op policy."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: one of {', '.join(CHECKPOINT_MODES)}")
    kwargs: dict[str, Any] = {"use_reentrant": False}  # the reentrant variant needs inputs that require grad
    if mode == "selective-op":
        kwargs["context_fn"] = selective_op_context
    enable: Callable[..., None] | None = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(f"activation checkpointing: {type(model).__name__} has no switch for it outside ShardFormer")
    enable(gradient_checkpointing_kwargs=kwargs)
