"""Experts as stacked weights in the transformers 5 layout, computed on tokens already grouped by expert.

`grouped_linear` multiplies each expert's contiguous block of rows by that expert's weight with one torch grouped
matmul (`torch.nn.functional.grouped_mm`, or `torch._grouped_mm` on older torch) where the device, dtype and
alignment allow it (CPU: fp32/bf16/fp16 with every row 16-byte aligned; CUDA: bf16 on compute capability 8.0+), and
with one matmul per expert otherwise. With `fp8` options (use_fp8) a projection whose dims `fp8_eligible` accepts runs
one `cx_mesh.fp8.fp8_linear` per expert instead (each expert's rows and weight get their own dynamic scales; torch has
no fp8 grouped matmul on CPU). `expert_mlp` is the gated (SwiGLU) or plain two-layer expert built on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from cx_mesh import fp8 as cx_fp8
from cx_moe._grad_scale import scale_grad
from cx_moe._options import Activation, ExpertImplementation

__all__ = ["GroupedExperts", "activation_function", "expert_mlp", "grouped_linear", "grouped_mm_supported"]

_GROUPED_MM: Callable[..., torch.Tensor] | None = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def activation_function(activation: Activation) -> Callable[[torch.Tensor], torch.Tensor]:
    if activation is Activation.SILU:
        return F.silu
    if activation is Activation.GELU:
        return F.gelu
    if activation is Activation.GELU_TANH:
        return lambda x: F.gelu(x, approximate="tanh")
    return F.relu


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped matmul runs `x [N, in]` against `weight [E, out, in]` here (else: the loop)."""
    if _GROUPED_MM is None or x.dtype != weight.dtype or x.device != weight.device:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    size = x.element_size()
    aligned = all((d * size) % 16 == 0 for d in weight.shape[1:])
    return aligned and _address_aligned(x) and _address_aligned(weight)


def _address_aligned(tensor: torch.Tensor) -> bool:
    """Whether the tensor's first element sits on a 16-byte boundary. A FakeTensor (cx-plan's memory trace) has no
    address: its storage would come from the CPU allocator (64-byte aligned), so its offset decides."""
    if isinstance(tensor, FakeTensor):
        return (tensor.storage_offset() * tensor.element_size()) % 16 == 0
    return tensor.data_ptr() % 16 == 0


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: the CPU grouped-matmul backward rejects the
    expanded (stride-0) gradients that e.g. `.sum()` produces."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: Sequence[int],
    implementation: ExpertImplementation = ExpertImplementation.AUTO,
    fp8: cx_fp8.Fp8Options | None = None,
) -> torch.Tensor:
    """Rows `x [N, in]` grouped by expert (`counts[e]` rows for expert e, in order) times `weight [E, out, in]`
    transposed: [N, out]. Every expert's weight joins the autograd graph, so an expert with no rows gets a zero
    gradient rather than none (data-parallel reductions then see the same parameters on every rank). `fp8`: in fp8
    where `fp8_eligible(in, out, fp8)` (see the module docstring)."""
    if len(counts) != weight.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(
            f"counts {list(counts)} must have one entry per expert ({weight.shape[0]}) "
            f"summing to the rows ({x.shape[0]})"
        )
    if fp8 is not None and cx_fp8.fp8_eligible(weight.shape[2], weight.shape[1], fp8):
        return _fp8_grouped_linear(x, weight, counts, fp8.recipe)
    use_grouped = implementation is ExpertImplementation.GROUPED_MM or (
        implementation is ExpertImplementation.AUTO and grouped_mm_supported(x, weight)
    )
    use_grouped = use_grouped and x.shape[0] > 0  # no rows: the CPU kernel's backward rejects the empty gradient
    if use_grouped:
        if _GROUPED_MM is None:
            raise RuntimeError("this torch has no grouped matmul (torch.nn.functional.grouped_mm): use 'loop'")
        offsets = torch.tensor(counts, device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        out = _GROUPED_MM(x.contiguous(), weight.transpose(-2, -1), offs=offsets)
        result: torch.Tensor = _ContiguousGrad.apply(out)
        return result
    pieces = torch.split(x, list(counts))
    return torch.cat([F.linear(piece, weight[e]) for e, piece in enumerate(pieces)], dim=0)


def _fp8_grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int], recipe: cx_fp8.ScalingRecipe
) -> torch.Tensor:
    """One fp8 matmul per expert with rows; an expert without rows multiplies its empty block in high precision
    (nothing to quantize), which keeps its weight in the graph with a zero gradient."""
    pieces = torch.split(x, list(counts))
    outs = [
        cx_fp8.fp8_linear(piece, weight[e], recipe=recipe) if piece.shape[0] else F.linear(piece, weight[e])
        for e, piece in enumerate(pieces)
    ]
    return torch.cat(outs, dim=0)


def expert_mlp(
    x: torch.Tensor,
    counts: Sequence[int],
    up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    *,
    gated: bool,
    implementation: ExpertImplementation = ExpertImplementation.AUTO,
    apply_gate: Callable[[torch.Tensor], torch.Tensor] | None = None,
    fp8: cx_fp8.Fp8Options | None = None,
) -> torch.Tensor:
    """Each expert's MLP on its rows: gated `down(act(gate) * up)` with `up` = gate_up_proj [E, 2I, H] (gate rows
    first, as transformers' `chunk(2)`), or plain `down(act(up))`. `apply_gate` overrides the gated split. `fp8`:
    both projections in fp8 where eligible (`grouped_linear`)."""
    hidden = grouped_linear(x, up, counts, implementation, fp8)
    if gated:
        if apply_gate is not None:
            hidden = apply_gate(hidden)
        else:
            gate, value = hidden.chunk(2, dim=-1)
            hidden = act(gate) * value
    else:
        hidden = act(hidden)
    return grouped_linear(hidden, down, counts, implementation, fp8)


class GroupedExperts(nn.Module):
    """`num_experts` experts (this rank's slice under expert parallelism) as stacked parameters:
    `gate_up_proj [E, 2I, H]` (gated) or `up_proj [E, I, H]`, and `down_proj [E, H, I]`. `fp8` (None: off) makes
    the eligible projections compute in fp8 (use_fp8)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        gated: bool = True,
        activation: Activation = Activation.SILU,
        implementation: ExpertImplementation = ExpertImplementation.AUTO,
        initialize: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        fp8: cx_fp8.Fp8Options | None = None,
    ) -> None:
        super().__init__()
        self.fp8 = fp8
        self.num_experts = num_experts
        self.gated = gated
        self.activation = activation
        self.implementation = implementation
        rows = 2 * intermediate_size if gated else intermediate_size
        up = nn.Parameter(torch.empty(num_experts, rows, hidden_size, device=device, dtype=dtype))
        if gated:
            self.gate_up_proj = up
        else:
            self.up_proj = up
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, device=device, dtype=dtype)
        )
        if initialize:
            self.reset_parameters()
        self._act = activation_function(activation)

    def reset_parameters(self) -> None:
        """nn.Linear's default range, per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        for weight in (self.up_weight, self.down_proj):
            bound = 1.0 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    @property
    def up_weight(self) -> torch.Tensor:
        return self.gate_up_proj if self.gated else self.up_proj

    def forward(self, x: torch.Tensor, counts: Sequence[int], grad_scale: float = 1.0) -> torch.Tensor:
        """Rows grouped by expert (`counts[e]` for expert e) -> their expert's output, same order. `grad_scale`
        multiplies the weights' gradients (1/ep under expert parallelism, see `scale_grad`)."""
        return expert_mlp(
            x,
            counts,
            scale_grad(self.up_weight, grad_scale),
            scale_grad(self.down_proj, grad_scale),
            self._act,
            gated=self.gated,
            implementation=self.implementation,
            fp8=self.fp8,
        )
