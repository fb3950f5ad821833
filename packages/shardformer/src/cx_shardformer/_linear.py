"""Column- and row-parallel linear layers (Megatron 1-D tensor parallelism) under ColossalAI's names.

`Linear1D_Col` splits the output features: each rank computes its slice of the output from the whole input.
`Linear1D_Row` splits the input features: each rank multiplies its slice of the input and the partial outputs are
summed. A column layer followed by a row layer needs one all-reduce forward and one backward. With
`seq_parallel_mode="split_gather"` the activations outside the pair are split along the sequence: the column
layer all-gathers its input (reduce-scatter backward) and the row layer reduce-scatters its output (all-gather
backward) instead of all-reducing it. `FusedLinear1D_Col` is a column layer whose output fuses several projections
(q/k/v, gate/up): each part is split separately so every rank holds its share of each.

The weight layout is torch's `nn.Linear` ([out, in]) here; the GPT-2 `Conv1D` variants ([in, out]) subclass these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from cx_mesh import ProcessGroup, all_reduce
from cx_shardformer._comm import (
    copy_to_parallel,
    gather_forward_reduce_scatter_backward,
    gather_forward_split_backward,
    group_size,
    reduce_forward,
    reduce_scatter_forward_gather_backward,
    split_forward_gather_backward,
)
from cx_shardformer._fp8 import maybe_fp8_linear
from cx_shardformer._overlap import column_overlap_forward, row_overlap_forward
from cx_shardformer._parallel_module import ParallelModule
from cx_shardformer._shard_spec import make_spec, shard_parameter_

__all__ = [
    "FusedLinear1D_Col",
    "Linear1D_Col",
    "Linear1D_Row",
    "check_seq_parallel_mode",
    "mark_input_grad_reduced",
    "sync_grad_over",
]

_LAYER_SP_MODES = ("split_gather",)


def check_seq_parallel_mode(mode: str | None, layer: str) -> bool:
    """True for the Megatron split/gather mode, False for None; a clear error for anything else."""
    if mode is None:
        return False
    if mode in _LAYER_SP_MODES:
        return True
    if mode in ("all_to_all", "ring"):
        raise ValueError(
            f"{layer}: seq_parallel_mode={mode!r} is sequence parallelism inside attention (ShardFormer's "
            f"sequence_parallelism_mode), not in linear layers; a layer takes seq_parallel_mode=None or 'split_gather'"
        )
    raise ValueError(f"{layer}: unknown seq_parallel_mode {mode!r}; expected None or 'split_gather'")


def sync_grad_over(param: nn.Parameter, group: ProcessGroup | None) -> None:
    """Sum `param`'s gradient over `group` as it is produced: a replicated parameter applied to one sequence shard
    (a norm, a row layer's bias under split_gather) gets only its shard's share otherwise. Registered once, and only
    on a parameter that requires a gradient (a frozen one, e.g. a frozen router or a base weight under LoRA, gets
    none to sum)."""
    synced: list[ProcessGroup | None] = getattr(param, "cx_grad_synced", [])
    if any(g is group for g in synced) or group_size(group) == 1 or not param.requires_grad:
        return

    def hook(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone()
        all_reduce(out, group=group)
        return out

    param.register_hook(hook)
    param.cx_grad_synced = [*synced, group]  # type: ignore[attr-defined]


_REDUCED = "cx_input_grad_reduced"


def mark_input_grad_reduced(tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    """Mark a block input whose backward already sums its gradient over `group` (a block-level `copy_to_parallel`,
    or split_gather's all-gather with its reduce-scatter backward). Column layers fed this exact tensor skip their
    own backward all-reduce, so q, k and v (or gate and up) share one reduction instead of one each."""
    setattr(tensor, _REDUCED, group)


def _new_linear_params(
    in_features: int, out_features: int, bias: bool, dtype: torch.dtype | None, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full-size parameters initialised as `nn.Linear` does (same seed on every rank gives the same values)."""
    plain = nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
    return plain.weight, plain.bias


class _ColumnBase(ParallelModule):
    """Shared by every column-parallel layer: weight split along the output features (possibly fused parts)."""

    _out_dim = 0  # where the output features live in the weight: 0 for nn.Linear, 1 for Conv1D
    sequence_overlap = False  # enable_sequence_overlap: split_gather's gather runs as a ring with the matmul

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight: torch.Tensor,
        bias_: torch.Tensor | None,
        process_group: ProcessGroup | None,
        gather_output: bool,
        seq_parallel_mode: str | None,
        seq_parallel_dim: int,
        skip_bias_add: bool,
        split_sizes: Sequence[int] | None,
        padded_out: int | None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self.in_features, self.out_features = in_features, out_features
        self.process_group = process_group
        self.gather_output = gather_output
        self.seq_parallel_mode = seq_parallel_mode
        self.seq_parallel_dim = seq_parallel_dim
        self._split_gather = check_seq_parallel_mode(seq_parallel_mode, name)
        self.skip_bias_add = skip_bias_add
        if skip_bias_add and gather_output:
            raise ValueError(f"{name}: skip_bias_add returns this rank's bias slice; it cannot go with gather_output")
        parts = tuple(split_sizes) if split_sizes is not None else (out_features,)
        if sum(parts) != out_features:
            raise ValueError(f"{name}: split_sizes {list(parts)} must add up to out_features={out_features}")
        world = group_size(process_group)
        self.spec = make_spec(self._out_dim, parts, world, padded_out, name)
        self.weight = shard_parameter_(weight, self.spec, process_group)
        self.bias: nn.Parameter | None
        if bias_ is not None:
            bias_ = shard_parameter_(bias_, make_spec(0, parts, world, padded_out, name), process_group)
        self.register_parameter("bias", bias_)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return maybe_fp8_linear(x, self.weight, bias, self.fp8_recipe)

    def _gathered(self, local: torch.Tensor) -> torch.Tensor:
        """All-gather the output features and put the fused parts back in their full order (padding stripped)."""
        world = group_size(self.process_group)
        out = gather_forward_split_backward(local, -1, self.process_group, self.fp8_communication)
        if len(self.spec.parts) > 1 and world > 1:
            per_rank = out.unflatten(-1, (world, -1))  # [..., world, local_total]
            pieces = per_rank.split(list(self.spec.local_parts()), dim=-1)
            out = torch.cat([piece.flatten(-2) for piece in pieces], dim=-1)
        if self.spec.padded > self.spec.full:
            out = out[..., : self.spec.full]
        return out

    def forward(self, input_: torch.Tensor) -> Any:
        if self.sequence_overlap:
            overlapped = column_overlap_forward(self, input_)
            if overlapped is not None:
                return overlapped
        if self._split_gather:
            x = gather_forward_reduce_scatter_backward(
                input_, self.seq_parallel_dim, self.process_group, self.fp8_communication
            )
        elif hasattr(input_, _REDUCED) and getattr(input_, _REDUCED) is self.process_group:
            x = input_  # the block's hook already sums this input's gradient over the group
        else:
            x = copy_to_parallel(input_, self.process_group, self.fp8_communication)
        out = self._matmul(x, None if self.skip_bias_add else self.bias)
        if self.gather_output:
            out = self._gathered(out)
        if self.skip_bias_add:
            return out, self.bias
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, parts={list(self.spec.parts)}, "
            f"tp={self.spec.world}, gather_output={self.gather_output}, seq_parallel_mode={self.seq_parallel_mode}"
        )


class Linear1D_Col(_ColumnBase):  # noqa: N801  (ColossalAI's public name)
    """`nn.Linear` with its output features split over `process_group`.

    `gather_output=True` all-gathers the output (every rank gets the full features); otherwise each rank keeps its
    slice, ready for a `Linear1D_Row`. `weight` / `bias_` (full-size Parameters) are sharded in place.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        process_group: ProcessGroup | None = None,
        gather_output: bool = False,
        seq_parallel_mode: str | None = None,
        seq_parallel_dim: int = 1,
        skip_bias_add: bool = False,
        weight: torch.Tensor | None = None,
        bias_: torch.Tensor | None = None,
    ) -> None:
        if weight is None:
            weight, bias_ = _new_linear_params(in_features, out_features, bias, dtype, device)
        super().__init__(
            in_features,
            out_features,
            weight,
            bias_ if bias else None,
            process_group,
            gather_output,
            seq_parallel_mode,
            seq_parallel_dim,
            skip_bias_add,
            None,
            None,
        )

    @classmethod
    def from_native_module(
        cls, module: nn.Module, process_group: ProcessGroup | None = None, **kwargs: Any
    ) -> Linear1D_Col:
        """Shard an `nn.Linear` in place (same Parameter objects) into a column-parallel layer."""
        linear = _require_linear(module, cls.__name__)
        return cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            process_group=process_group,
            weight=linear.weight,
            bias_=linear.bias,
            **kwargs,
        )


class FusedLinear1D_Col(_ColumnBase):  # noqa: N801  (ColossalAI's public name)
    """A column-parallel `nn.Linear` whose output concatenates several projections (`split_sizes`, e.g. q, k, v or
    gate, up); each projection is split over the ranks separately, so the local output is [q_r, k_r, v_r]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        process_group: ProcessGroup | None = None,
        split_sizes: Sequence[int] | None = None,
        gather_output: bool = False,
        seq_parallel_mode: str | None = None,
        seq_parallel_dim: int = 1,
        skip_bias_add: bool = False,
        weight: torch.Tensor | None = None,
        bias_: torch.Tensor | None = None,
    ) -> None:
        if split_sizes is None:
            raise ValueError(f"{type(self).__name__}: split_sizes (the fused projections' output sizes) is required")
        if weight is None:
            weight, bias_ = _new_linear_params(in_features, out_features, bias, dtype, device)
        super().__init__(
            in_features,
            out_features,
            weight,
            bias_ if bias else None,
            process_group,
            gather_output,
            seq_parallel_mode,
            seq_parallel_dim,
            skip_bias_add,
            split_sizes,
            None,
        )

    @classmethod
    def from_native_module(
        cls,
        module: nn.Module,
        process_group: ProcessGroup | None = None,
        split_sizes: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> FusedLinear1D_Col:
        """Shard a fused `nn.Linear` in place; `split_sizes` lists the fused projections' output sizes."""
        linear = _require_linear(module, cls.__name__)
        return cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            process_group=process_group,
            split_sizes=split_sizes,
            weight=linear.weight,
            bias_=linear.bias,
            **kwargs,
        )


class _RowBase(ParallelModule):
    """Shared by row-parallel layers: weight split along the input features, bias replicated."""

    _in_dim = 1  # where the input features live in the weight: 1 for nn.Linear, 0 for Conv1D
    sequence_overlap = False  # enable_sequence_overlap: split_gather's reduce-scatter runs as a ring with the matmul

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight: torch.Tensor,
        bias_: torch.Tensor | None,
        process_group: ProcessGroup | None,
        parallel_input: bool,
        seq_parallel_mode: str | None,
        seq_parallel_dim: int,
        skip_bias_add: bool,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self.in_features, self.out_features = in_features, out_features
        self.process_group = process_group
        self.parallel_input = parallel_input
        self.seq_parallel_mode = seq_parallel_mode
        self.seq_parallel_dim = seq_parallel_dim
        self._split_gather = check_seq_parallel_mode(seq_parallel_mode, name)
        self.skip_bias_add = skip_bias_add
        self.spec = make_spec(self._in_dim, (in_features,), group_size(process_group), None, name)
        self.weight = shard_parameter_(weight, self.spec, process_group)
        self.bias: nn.Parameter | None
        if bias_ is not None and not isinstance(bias_, nn.Parameter):
            raise TypeError(f"{name}: bias_ must be an nn.Parameter, got {type(bias_).__name__}")
        self.register_parameter("bias", bias_)
        if bias_ is not None and self._split_gather and not skip_bias_add:
            sync_grad_over(bias_, process_group)  # added to a sequence shard: its gradient is summed over ranks

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return maybe_fp8_linear(x, self.weight, None, self.fp8_recipe)

    def forward(self, input_: torch.Tensor) -> Any:
        if self.sequence_overlap:
            return row_overlap_forward(self, input_)
        group, fp8 = self.process_group, self.fp8_communication
        x = input_ if self.parallel_input else split_forward_gather_backward(input_, -1, group, fp8)
        out = self._matmul(x)
        if self._split_gather:
            out = reduce_scatter_forward_gather_backward(out, self.seq_parallel_dim, group, fp8)
        else:
            out = reduce_forward(out, group, fp8)
        if self.skip_bias_add:
            return out, self.bias
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp={self.spec.world}, "
            f"parallel_input={self.parallel_input}, seq_parallel_mode={self.seq_parallel_mode}"
        )


class Linear1D_Row(_RowBase):  # noqa: N801  (ColossalAI's public name)
    """`nn.Linear` with its input features split over `process_group`; partial outputs are summed (all-reduce, or
    reduce-scatter along the sequence under split_gather). `parallel_input=False` takes the full input and keeps
    this rank's slice of it."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        process_group: ProcessGroup | None = None,
        seq_parallel_mode: str | None = None,
        seq_parallel_dim: int = 1,
        parallel_input: bool = True,
        skip_bias_add: bool = False,
        weight: torch.Tensor | None = None,
        bias_: torch.Tensor | None = None,
    ) -> None:
        if weight is None:
            weight, bias_ = _new_linear_params(in_features, out_features, bias, dtype, device)
        super().__init__(
            in_features,
            out_features,
            weight,
            bias_ if bias else None,
            process_group,
            parallel_input,
            seq_parallel_mode,
            seq_parallel_dim,
            skip_bias_add,
        )

    @classmethod
    def from_native_module(
        cls, module: nn.Module, process_group: ProcessGroup | None = None, **kwargs: Any
    ) -> Linear1D_Row:
        """Shard an `nn.Linear` in place (same Parameter objects) into a row-parallel layer."""
        linear = _require_linear(module, cls.__name__)
        return cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            process_group=process_group,
            weight=linear.weight,
            bias_=linear.bias,
            **kwargs,
        )


def _require_linear(module: nn.Module, layer: str) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"{layer}.from_native_module expects an nn.Linear, got {type(module).__name__}")
    return module
