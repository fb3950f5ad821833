"""The fp8 error bounds the mesh fp8 tests share (derived in test_fp8_numerics's docstring): per element, per GEMM
against float64, and the sharp one against a float64 GEMM of cx's own quantized operands. Every recipe: scales per
tensor, per row, or per tile (BLOCKWISE; a's tiles are ACTIVATION_TILE, b's `b_tile`), recomputed here tile by
tile rather than through cx's code."""

from __future__ import annotations

import torch

from cx_mesh.fp8 import ACTIVATION_TILE, WEIGHT_BLOCK, ScalingRecipe, quantize
from cx_mesh.testing import unit_roundoff

U32 = unit_roundoff(torch.float32)


def scales(
    values: torch.Tensor, fp8_dtype: torch.dtype, recipe: ScalingRecipe, tile: tuple[int, int] = ACTIVATION_TILE
) -> torch.Tensor:
    """Each element's scale (broadcastable to the 2-D `values`): amax of its group over the fp8 max, at least
    float32's tiny."""
    if recipe is ScalingRecipe.TENSORWISE:
        amax = values.abs().amax()
    elif recipe is ScalingRecipe.ROWWISE:
        amax = values.abs().amax(-1, keepdim=True)
    else:
        amax = torch.empty_like(values)
        for i in range(0, values.shape[0], tile[0]):
            for j in range(0, values.shape[1], tile[1]):
                amax[i : i + tile[0], j : j + tile[1]] = values[i : i + tile[0], j : j + tile[1]].abs().max()
    return (amax / torch.finfo(fp8_dtype).max).clamp(min=torch.finfo(torch.float32).tiny)


def element_bound(
    values: torch.Tensor, fp8_dtype: torch.dtype, recipe: ScalingRecipe, tile: tuple[int, int] = ACTIVATION_TILE
) -> torch.Tensor:
    """e(x) = max(u|x|, s * tiny * u) for a 2-D float64 operand quantized along its rows, plus 3 float32 roundings
    of x (x / s before the cast, the scale itself, data * s on dequantize)."""
    u, tiny = unit_roundoff(fp8_dtype), torch.finfo(fp8_dtype).tiny
    per_element = torch.maximum(u * values.abs(), scales(values, fp8_dtype, recipe, tile) * tiny * u)
    return per_element + 3 * U32 * values.abs()


def _accumulated(
    reference: torch.Tensor,
    magnitudes: torch.Tensor,
    inner: int,
    out: torch.dtype,
    before: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """`before` plus float32 accumulation over `inner` (+ 3) products of the given |a| @ |b|.T `magnitudes`, plus the
    rounding to `out` of a result that far from `reference`: the tail both GEMM bounds share."""
    k = inner + 3
    before_output = before + k * U32 / (1 - k * U32) * magnitudes
    return before_output + unit_roundoff(out) * (reference.abs() + before_output)


def gemm_bound(
    a: torch.Tensor,
    b: torch.Tensor,
    a_dtype: torch.dtype,
    b_dtype: torch.dtype,
    recipe: ScalingRecipe,
    out: torch.dtype,
    b_tile: tuple[int, int] = WEIGHT_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact a @ b.T (float64) and the bound on |fp8 result - exact|."""
    a, b = a.double(), b.double()
    ea, eb = element_bound(a, a_dtype, recipe), element_bound(b, b_dtype, recipe, b_tile)
    exact = a @ b.T
    quantization = ea @ b.abs().T + a.abs() @ eb.T + ea @ eb.T
    return exact, _accumulated(exact, (a.abs() + ea) @ (b.abs() + eb).T, a.shape[1], out, quantization)


def sharp_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    a_dtype: torch.dtype,
    b_dtype: torch.dtype,
    recipe: ScalingRecipe,
    out: torch.dtype,
    b_tile: tuple[int, int] = WEIGHT_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """a^ @ b^.T in float64 from cx's quantized operands, and the float32-accumulation + output-rounding bound."""
    blockwise = recipe is ScalingRecipe.BLOCKWISE
    qa = quantize(a.contiguous(), a_dtype, recipe, ACTIVATION_TILE if blockwise else None)
    qb = quantize(b.contiguous(), b_dtype, recipe, b_tile if blockwise else None)
    da, db = qa.dequantize(torch.float64), qb.dequantize(torch.float64)
    reference = da @ db.T
    return reference, _accumulated(reference, da.abs() @ db.abs().T, a.shape[1], out)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor | float, what: str) -> None:
    excess = (actual.double().reshape(expected.shape) - expected).abs() - bound
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    assert excess.max() <= 0, f"{what}: off by {excess.max().item():.3g} beyond the bound"
