"""enable_jit_fused in the Hugging Face decoder policies: which element-wise chains run as `_fused` kernels.

- GPT-2's MLP: c_fc's bias + GELU in one kernel, c_proj's bias + dropout in another (the linear layers return their
  bias unadded). The residual adds live in transformers' `GPT2Block.forward` and stay unfused.
- Llama-style gated MLPs: act(gate) * up in one kernel.
- Llama-style RMSNorm: one kernel, unless enable_fused_normalization already put torch's fused `nn.RMSNorm` there.

A module is fused only when its `forward` is, source for source, the transformers code the kernel reproduces
(GPT2MLP, LlamaMLP, LlamaRMSNorm and the "Copied from" twins of other models), so a model with different math is
left alone. enable_jit_fused with nothing to fuse raises; under enable_all_optimization it warns instead.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cx_shardformer._config import ShardConfig
from cx_shardformer._fused import bias_act, bias_dropout, rms_norm, swiglu
from cx_shardformer._linear import _ColumnBase, _RowBase

__all__ = ["apply_jit_fused"]


def _source(function: Any) -> str | None:
    try:
        return inspect.getsource(function).strip()
    except (OSError, TypeError):
        return None


@functools.cache
def _reference_sources() -> dict[str, str | None]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    return {
        "gpt2_mlp": _source(GPT2MLP.forward),
        "gated_mlp": _source(LlamaMLP.forward),
        "rms_norm": _source(LlamaRMSNorm.forward),
    }


def _without_bias(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`layer(x)` with its bias returned instead of added: cx's TP layers by skip_bias_add, a plain nn.Linear or
    GPT-2 Conv1D ([in, out] weight) by its matmul alone."""
    if isinstance(layer, _ColumnBase | _RowBase):
        out, bias = layer(x)
        return out, bias
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"enable_jit_fused: cannot split the bias off {type(layer).__name__}")
    if isinstance(layer, nn.Linear):
        return F.linear(x, weight), bias
    return x @ weight, bias  # transformers' Conv1D


def _gpt2_mlp_forward(mlp: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    hidden, bias = _without_bias(mlp.c_fc, hidden_states)
    hidden = bias_act(hidden, bias, mlp.act)
    out, bias = _without_bias(mlp.c_proj, hidden)
    return bias_dropout(out, bias, mlp.dropout)


def _gated_mlp_forward(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = mlp.down_proj(swiglu(mlp.gate_proj(x), mlp.up_proj(x), mlp.act_fn))
    return out


def _rms_norm_forward(norm: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, norm.weight, float(norm.variance_epsilon))


def _skip_bias(layer: nn.Module) -> None:
    if isinstance(layer, _ColumnBase | _RowBase):
        if getattr(layer, "gather_output", False):
            raise ValueError(f"enable_jit_fused: {type(layer).__name__} gathers its output; cannot return its bias")
        layer.skip_bias_add = True


_FUSIONS: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    "gpt2_mlp": _gpt2_mlp_forward,
    "gated_mlp": _gated_mlp_forward,
    "rms_norm": _rms_norm_forward,
}


def apply_jit_fused(model: nn.Module, config: ShardConfig) -> list[str]:
    """Route the fusable modules of `model` through the compiled kernels (module docs); returns their names."""
    references = _reference_sources()
    fused: list[str] = []
    for name, module in model.named_modules():
        source = _source(type(module).forward)
        kind = next((k for k, ref in references.items() if ref is not None and source == ref), None)
        if kind is None:
            continue
        if kind == "gpt2_mlp":
            _skip_bias(module.c_fc)
            _skip_bias(module.c_proj)
        setattr(module, "forward", functools.partial(_FUSIONS[kind], module))  # noqa: B010  (instance override)
        fused.append(name)
    if not fused:
        message = f"enable_jit_fused: {type(model).__name__} has no GPT-2 MLP, Llama-style gated MLP or RMSNorm to fuse"
        if not config.enable_all_optimization:
            raise ValueError(message)
        warnings.warn(message, UserWarning, stacklevel=2)
    return fused
