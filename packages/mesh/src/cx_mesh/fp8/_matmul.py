"""`fp8_linear`: F.linear computed with fp8 GEMMs (torch._scaled_mm) and dynamic scaling, forward and backward.

Forward: input and weight quantized to E4M3. Backward: grad_output quantized to E5M2 (gradients need the range) for
both GEMMs, grad_input = g @ W and grad_weight = g^T @ x. Every GEMM quantizes its operands along the reduction dim,
so ROWWISE scales are per row of the left operand and per column of the right one, as torch._scaled_mm takes them.
The E5M2 gradient is always the left operand: torch's CUDA row-wise kernels (CUTLASS RowwiseScaledMM) take E4M3 or
E5M2 on the left but only E4M3 on the right, so `scaled_matmul` refuses a right E5M2 operand on every device.
The high-precision input and weight are saved for backward and re-quantized along the axis each GEMM needs.

BLOCKWISE (DeepSeek-V3's recipe) quantizes every operand to E4M3, gradients included (the fine-grained scales give
them the range E5M2 was for): activations and gradients in `ACTIVATION_TILE`s (1 x 128 along the reduction dim),
weights in `WEIGHT_BLOCK`s (128 x 128, the same blocks for W and the backward's W^T). torch 2.13's CPU _scaled_mm
takes no tile scales, so `_blockwise_mm` emulates the GEMM (dequantize each operand with its tile scales, multiply in
float32); it takes exactly the operands and scales a blockwise kernel (sm90's _scaled_mm with 1x128 / 128x128
scales, DeepGEMM) would, so such a kernel can replace it without touching the rest.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from cx_mesh.fp8._formats import ACTIVATION_TILE, E4M3, E5M2, WEIGHT_BLOCK, Fp8Tensor, ScalingRecipe, quantize
from cx_mesh.fp8._options import FP8_ALIGNMENT

__all__ = ["fp8_linear", "fp8_linear_input_grad", "fp8_linear_weight_grad", "fp8_matmul_supported"]

_OUTPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MIN_CUDA_CAPABILITY = (8, 9)


def fp8_matmul_supported(device: torch.device | str) -> bool:
    """Whether torch._scaled_mm runs fp8 GEMMs on `device`: CPU (torch >= 2.13 ships a CPU kernel) and CUDA devices
    of compute capability 8.9 (Ada) or newer; False elsewhere."""
    device = torch.device(device)
    if not hasattr(torch, "_scaled_mm"):
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= _MIN_CUDA_CAPABILITY
    return False


def _require_supported(device: torch.device) -> None:
    if fp8_matmul_supported(device):
        return
    if not hasattr(torch, "_scaled_mm"):
        raise RuntimeError(f"fp8_linear needs torch._scaled_mm, which torch {torch.__version__} does not have")
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        raise RuntimeError(
            f"fp8_linear: {device} ({torch.cuda.get_device_name(device)}) has compute capability {major}.{minor}; "
            "fp8 matmuls (torch._scaled_mm) need 8.9 or newer (Ada, Hopper, Blackwell). Check "
            "cx_mesh.fp8.fp8_matmul_supported(device) first and keep the model in high precision there"
        )
    raise RuntimeError(f"fp8_linear: torch._scaled_mm has no fp8 kernel for device type {device.type!r}")


def _pad_to(tensor: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    pad_rows, pad_cols = rows - tensor.shape[0], cols - tensor.shape[1]
    return F.pad(tensor, (0, pad_cols, 0, pad_rows)) if pad_rows or pad_cols else tensor


def _round_up(value: int) -> int:
    return -(-value // FP8_ALIGNMENT) * FP8_ALIGNMENT


def _blockwise_mm(qa: Fp8Tensor, qb: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """qa @ qb.T from tile-scaled fp8 operands (a's `ACTIVATION_TILE` scales, b's tiles either kind), emulated: both
    dequantized in float32, one float32 GEMM, rounded to `out_dtype` once. The seam for a blockwise fp8 kernel."""
    return (qa.dequantize(torch.float32) @ qb.dequantize(torch.float32).t()).to(out_dtype)


def scaled_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    a_dtype: torch.dtype,
    b_dtype: torch.dtype,
    recipe: ScalingRecipe,
    out_dtype: torch.dtype,
    b_tile: tuple[int, int] = WEIGHT_BLOCK,
) -> torch.Tensor:
    """a @ b.T for a (M, K) and b (N, K) in high precision, each quantized along K (the reduction dim).

    On CUDA, K and N are zero-padded to multiples of 16 (cuBLASLt's fp8 requirement; zeros add nothing to the sums)
    and the output sliced back; rowwise GEMMs there produce bf16 (the only output cuBLASLt takes for them) and are
    cast to `out_dtype`. BLOCKWISE quantizes a in `ACTIVATION_TILE`s and b in `b_tile`s (`WEIGHT_BLOCK` for a weight,
    `ACTIVATION_TILE` for an activation) and computes with `_blockwise_mm` on every device."""
    if recipe is ScalingRecipe.BLOCKWISE:
        if a_dtype != E4M3 or b_dtype != E4M3:
            raise ValueError(
                f"scaled_matmul: BLOCKWISE takes E4M3 operands (DeepSeek-V3's recipe), got {a_dtype} and {b_dtype}"
            )
        if b_tile not in (ACTIVATION_TILE, WEIGHT_BLOCK):
            raise ValueError(f"scaled_matmul: b_tile must be {ACTIVATION_TILE} or {WEIGHT_BLOCK}, got {b_tile}")
        qa = quantize(a.contiguous(), a_dtype, recipe, ACTIVATION_TILE)
        return _blockwise_mm(qa, quantize(b.contiguous(), b_dtype, recipe, b_tile), out_dtype)
    if recipe is ScalingRecipe.ROWWISE and b_dtype != E4M3:
        raise ValueError(
            f"scaled_matmul: ROWWISE takes an E4M3 right operand, got {b_dtype} (torch's CUDA row-wise fp8 kernels "
            "accept E5M2 only on the left; pass the gradient as the left operand)"
        )
    m, n = a.shape[0], b.shape[0]
    if a.device.type == "cuda":
        k = _round_up(a.shape[1])
        a, b = _pad_to(a, m, k), _pad_to(b, _round_up(n), k)
    qa, qb = quantize(a.contiguous(), a_dtype, recipe), quantize(b.contiguous(), b_dtype, recipe)
    rowwise_cuda = recipe is ScalingRecipe.ROWWISE and a.device.type == "cuda"
    mm_dtype = torch.bfloat16 if rowwise_cuda else out_dtype
    # torch's CPU kernel computes (acc * scale_a) * scale_b: a huge scale_a overflows there although the product
    # is in range (activations ~1e37 against weights ~1e-37). Moving a power of two from scale_a to scale_b
    # (exact) brings the largest scale_a to about 1, so only a result that really overflows does.
    shift = torch.exp2(-torch.round(torch.log2(qa.scale.amax())))
    scale_a, scale_b = qa.scale * shift, qb.scale / shift
    if recipe is ScalingRecipe.ROWWISE:
        scale_b = scale_b.t()  # (1, N): one scale per column of the right operand
    elif a.device.type == "cpu":
        # torch 2.13's CPU kernel is ~500x slower with scalar scales than with per-row ones (55 ms vs 0.1 ms for
        # 64x64x64, measured here): the same scale repeated per row and column gives the identical result, fast.
        scale_a, scale_b = scale_a.expand(m, 1).contiguous(), scale_b.expand(1, n).contiguous()
    out = torch._scaled_mm(qa.data, qb.data.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=mm_dtype)
    return out[:m, :n].to(out_dtype)


class _Fp8Linear(torch.autograd.Function):
    """F.linear with fp8 GEMMs; bias added and its gradient summed in high precision."""

    @staticmethod
    def forward(
        ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: ScalingRecipe
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.recipe = recipe
        ctx.bias_dtype = None if bias is None else bias.dtype
        x = input.reshape(-1, input.shape[-1])
        if bias is None:
            out = scaled_matmul(x, weight, E4M3, E4M3, recipe, input.dtype)
        else:  # GEMM output and bias added in float32, rounded to input's dtype once
            out = (scaled_matmul(x, weight, E4M3, E4M3, recipe, torch.float32) + bias.float()).to(input.dtype)
        return out.reshape(*input.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        recipe: ScalingRecipe = ctx.recipe
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = fp8_linear_input_grad(grad_output, weight, recipe, input.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = fp8_linear_weight_grad(grad_output, input, recipe, weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).float().sum(0).to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None


def _grad_dtype(recipe: ScalingRecipe) -> torch.dtype:
    """The gradient's fp8 format: E5M2 (range), E4M3 with BLOCKWISE (its fine scales give the range)."""
    return E4M3 if recipe is ScalingRecipe.BLOCKWISE else E5M2


def fp8_linear_input_grad(
    grad_output: torch.Tensor, weight: torch.Tensor, recipe: ScalingRecipe, dtype: torch.dtype
) -> torch.Tensor:
    """`fp8_linear`'s input gradient, grad_output (..., N) @ weight (N, K) as an fp8 GEMM reducing over the output
    features (grad_output E5M2, E4M3 with BLOCKWISE; weight E4M3), in `dtype`. Public so that code computing a linear
    layer's backward piece by piece (cx_shardformer's sequence-overlap ring, one sequence chunk at a time) runs the
    same GEMM as fp8_linear's autograd."""
    g = grad_output.reshape(-1, grad_output.shape[-1])
    out = scaled_matmul(g, weight.t(), _grad_dtype(recipe), E4M3, recipe, dtype)
    return out.reshape(*grad_output.shape[:-1], weight.shape[1])


def fp8_linear_weight_grad(
    grad_output: torch.Tensor, input: torch.Tensor, recipe: ScalingRecipe, dtype: torch.dtype
) -> torch.Tensor:
    """`fp8_linear`'s weight gradient, grad_output^T (N, M) @ input (M, K) over every token as an fp8 GEMM (both
    operands activation-like: `ACTIVATION_TILE`s with BLOCKWISE), in `dtype`, [out, in] as the weight."""
    g = grad_output.reshape(-1, grad_output.shape[-1])
    x = input.reshape(-1, input.shape[-1])
    return scaled_matmul(g.t(), x.t(), _grad_dtype(recipe), E4M3, recipe, dtype, ACTIVATION_TILE)


def fp8_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    recipe: ScalingRecipe = ScalingRecipe.TENSORWISE,
) -> torch.Tensor:
    """F.linear(input, weight, bias) computed in fp8: input and weight quantized to E4M3 for the forward GEMM,
    grad_output to E5M2 for both backward GEMMs (E4M3 with BLOCKWISE). Output, grad_input and grad_weight come back
    in input's / weight's own dtypes (float16, bfloat16 or float32); bias is added in float32. Any leading dims of
    input; `weight` is any (out, in) tensor (a TP shard, Conv1D's weight.t(), one expert's slice). Raises where
    torch._scaled_mm has no fp8 kernel for the device (see `fp8_matmul_supported`), never silently falling back to
    high precision."""
    if weight.dim() != 2:
        raise ValueError(f"fp8_linear needs a 2-D (out_features, in_features) weight, got shape {tuple(weight.shape)}")
    if input.dim() < 1 or input.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fp8_linear: input's last dim must equal weight's in_features {weight.shape[1]}, got {tuple(input.shape)}"
        )
    for name, tensor in (("input", input), ("weight", weight)):
        if tensor.dtype not in _OUTPUT_DTYPES:
            raise TypeError(f"fp8_linear takes a float16/bfloat16/float32 {name}, got {tensor.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"fp8_linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not isinstance(recipe, ScalingRecipe):
        raise TypeError(f"fp8_linear: recipe must be a ScalingRecipe, got {recipe!r}")
    _require_supported(input.device)
    out: torch.Tensor = _Fp8Linear.apply(input, weight, bias, recipe)
    return out
