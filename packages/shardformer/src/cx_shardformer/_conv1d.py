"""GPT-2's `Conv1D` (weight stored [in, out], `y = x @ W + b`) as column- and row-parallel layers.

`GPT2FusedLinearConv1D_Col` covers GPT-2's fused `c_attn` (q, k, v in one weight: `split_sizes=[h, h, h]` or
`n_fused=3`) and its plain `c_fc` (one part); `GPT2FusedLinearConv1D_Row` is `c_proj`. transformers is not imported:
any module with a 2-D `weight` [in, out], a `bias` [out] and `nf` (out features) is accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from cx_mesh import ProcessGroup
from cx_mesh.fp8 import ScalingRecipe, fp8_linear
from cx_shardformer._linear import _ColumnBase, _RowBase

__all__ = ["GPT2FusedLinearConv1D_Col", "GPT2FusedLinearConv1D_Row"]


def _conv1d_shape(module: nn.Module, layer: str) -> tuple[int, int, nn.Parameter, nn.Parameter | None]:
    weight = getattr(module, "weight", None)
    if not hasattr(module, "nf") or not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        raise TypeError(f"{layer}.from_native_module expects a transformers Conv1D, got {type(module).__name__}")
    bias = getattr(module, "bias", None)
    return int(weight.shape[0]), int(weight.shape[1]), weight, bias if isinstance(bias, nn.Parameter) else None


def _addmm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: ScalingRecipe | None
) -> torch.Tensor:
    if recipe is not None:  # use_fp8: fp8_linear takes the [out, in] view of the [in, out] weight
        return fp8_linear(x, weight.t(), bias, recipe)
    out = x @ weight
    return out if bias is None else out + bias


class GPT2FusedLinearConv1D_Col(_ColumnBase):  # noqa: N801  (ColossalAI's public name)
    """Column-parallel `Conv1D` (output features split; fused parts split separately)."""

    _out_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        process_group: ProcessGroup | None = None,
        split_sizes: Sequence[int] | None = None,
        gather_output: bool = False,
        seq_parallel_mode: str | None = None,
        seq_parallel_dim: int = 1,
        skip_bias_add: bool = False,
        *,
        weight: torch.Tensor,
        bias_: torch.Tensor | None = None,
    ) -> None:
        super().__init__(
            in_features,
            out_features,
            weight,
            bias_,
            process_group,
            gather_output,
            seq_parallel_mode,
            seq_parallel_dim,
            skip_bias_add,
            split_sizes,
            None,
        )

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _addmm(x, self.weight, bias, self.fp8_recipe)

    @classmethod
    def from_native_module(
        cls,
        module: nn.Module,
        process_group: ProcessGroup | None = None,
        split_sizes: Sequence[int] | None = None,
        n_fused: int | None = None,
        **kwargs: Any,
    ) -> GPT2FusedLinearConv1D_Col:
        """Shard a `Conv1D` in place. `split_sizes` (or `n_fused` equal parts) describe a fused weight."""
        in_features, out_features, weight, bias = _conv1d_shape(module, cls.__name__)
        if split_sizes is None and n_fused is not None:
            if out_features % n_fused != 0:
                raise ValueError(f"{cls.__name__}: {out_features} output features do not split into {n_fused} parts")
            split_sizes = [out_features // n_fused] * n_fused
        return cls(
            in_features,
            out_features,
            process_group=process_group,
            split_sizes=split_sizes,
            weight=weight,
            bias_=bias,
            **kwargs,
        )


class GPT2FusedLinearConv1D_Row(_RowBase):  # noqa: N801  (ColossalAI's public name)
    """Row-parallel `Conv1D` (input features split, partial outputs summed, bias replicated)."""

    _in_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        process_group: ProcessGroup | None = None,
        seq_parallel_mode: str | None = None,
        seq_parallel_dim: int = 1,
        parallel_input: bool = True,
        skip_bias_add: bool = False,
        *,
        weight: torch.Tensor,
        bias_: torch.Tensor | None = None,
    ) -> None:
        super().__init__(
            in_features,
            out_features,
            weight,
            bias_,
            process_group,
            parallel_input,
            seq_parallel_mode,
            seq_parallel_dim,
            skip_bias_add,
        )

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _addmm(x, self.weight, None, self.fp8_recipe)

    @classmethod
    def from_native_module(
        cls, module: nn.Module, process_group: ProcessGroup | None = None, **kwargs: Any
    ) -> GPT2FusedLinearConv1D_Row:
        """Shard a `Conv1D` in place into a row-parallel layer."""
        in_features, out_features, weight, bias = _conv1d_shape(module, cls.__name__)
        return cls(in_features, out_features, process_group=process_group, weight=weight, bias_=bias, **kwargs)
