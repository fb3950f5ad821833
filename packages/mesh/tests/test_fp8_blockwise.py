"""BLOCKWISE fp8 (DeepSeek-V3's recipe): 1x128 tiles for activations and gradients, 128x128 blocks for weights, every
operand E4M3, against float64.

The recipe's bound (derived): a tile's scale maps its amax onto E4M3's max (448), so every element of the tile that
stays in E4M3's normal range after scaling is rounded with relative error <= u = 2^-4 (3 mantissa bits), and one
below it (|x| < 2^-6 s) by at most half the subnormal spacing, s * 2^-9 * u (fp8_bound_helpers.element_bound adds 3
float32 roundings). A product of two such elements errs by <= (2u + u^2)|a||b|, so a GEMM output by
<= (2^-3 + 2^-8) sum_k |a_k||b_k| plus the float32 accumulation, gamma_(K+3) sum |a^||b^|, and one rounding to the
output dtype. Finer scale groups do not change u; they change which elements fall below the normal range: an
outlier drags down only the 128 (or 128x128) elements of its own tile, not its whole row or tensor, which the
outlier test shows against TENSORWISE.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cx_mesh.fp8 import (
    ACTIVATION_TILE,
    E4M3,
    WEIGHT_BLOCK,
    Fp8Linear,
    Fp8Options,
    ScalingRecipe,
    convert_to_fp8,
    fp8_linear,
    quantize,
)
from cx_mesh.testing import unit_roundoff
from fp8_bound_helpers import U32, assert_within, element_bound, gemm_bound, scales, sharp_reference

BLOCKWISE = ScalingRecipe.BLOCKWISE
_U = unit_roundoff(E4M3)  # 2^-4


def test_tile_shapes_are_deepseek_v3s() -> None:
    assert ACTIVATION_TILE == (1, 128)
    assert WEIGHT_BLOCK == (128, 128)


@pytest.mark.parametrize("tile", [ACTIVATION_TILE, WEIGHT_BLOCK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_quantize_error_per_tile_within_bound(tile: tuple[int, int], dtype: torch.dtype) -> None:
    """(3, 100, 300): 300 rows and 300 columns are not multiples of 128, so the last tiles of both dims are
    remainders (44 columns; 44 rows for 128x128 blocks). Every tile's scale is its own amax / 448 (recomputed tile by
    tile), and every element is within e(x) of the float64 value."""
    generator = torch.Generator().manual_seed(0)
    values = (torch.randn(3, 100, 300, generator=generator) * torch.logspace(-2, 2, 300)).to(dtype)
    quantized = quantize(values, E4M3, BLOCKWISE, tile)
    assert quantized.data.shape == values.shape
    assert quantized.data.dtype == E4M3
    assert quantized.tile == tile
    assert quantized.scale.shape == (-(-300 // tile[0]), 3)
    flat = values.double().reshape(300, 300)
    expected = scales(flat, E4M3, BLOCKWISE, tile)[:: tile[0], :: tile[1]]
    assert torch.equal(quantized.scale.double(), expected.float().double())
    bound = element_bound(flat, E4M3, BLOCKWISE, tile)
    assert_within(quantized.dequantize(torch.float64), flat, bound, "quantize")
    assert quantized.dequantize(dtype).dtype == dtype


def test_blockwise_quantize_isolates_zero_and_non_finite_tiles() -> None:
    values = torch.ones(4, 256)
    values[1, 3] = float("inf")
    values[2, 128:] = 0.0
    restored = quantize(values, E4M3, BLOCKWISE).dequantize()
    assert not torch.isfinite(restored[1, :128]).any()  # the inf's tile is poisoned, so an overflow check sees it
    assert torch.equal(restored[1, 128:], torch.ones(128))  # its row's other tile is not
    assert torch.equal(restored[2], values[2])  # an all-zero tile: zeros, no 0/0
    assert torch.equal(restored[[0, 3]], values[[0, 3]])


def test_blockwise_quantize_refuses_bad_tiles() -> None:
    with pytest.raises(ValueError, match="tile is BLOCKWISE's scale group, not ROWWISE's"):
        quantize(torch.ones(4, 4), E4M3, ScalingRecipe.ROWWISE, ACTIVATION_TILE)
    with pytest.raises(ValueError, match="two positive ints"):
        quantize(torch.ones(4, 4), E4M3, BLOCKWISE, (0, 128))
    with pytest.raises(ValueError, match="at least one dimension"):
        quantize(torch.tensor(1.0), E4M3, BLOCKWISE)


def _linear_with_outliers(outliers: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """150 tokens x 300 in-features -> 200 out-features (none a multiple of 128); with `outliers`, token 7's channel
    5 is 10^6 times the rest, and weight block (rows 128:, cols 128:256) 10^6 times the other weights."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 75, 300, generator=generator)
    weight = torch.randn(200, 300, generator=generator) / 16
    bias = torch.randn(200, generator=generator)
    if outliers:
        x[0, 7, 5] = 1e6
        weight[128:, 128:256] *= 1e6
    return x, weight, bias, torch.randn(2, 75, 200, generator=generator)


def _run(
    recipe: ScalingRecipe, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, grad_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    y = fp8_linear(leaves[0], leaves[1], leaves[2], recipe)
    y.backward(grad_output)
    grads = [leaf.grad for leaf in leaves]
    grad_x, grad_w, grad_b = grads
    assert grad_x is not None
    assert grad_w is not None
    assert grad_b is not None
    return y.detach(), grad_x, grad_w, grad_b


@pytest.mark.parametrize("outliers", [False, True])
def test_blockwise_linear_forward_and_gradients_within_bound(outliers: bool) -> None:
    x, weight, bias, grad_output = _linear_with_outliers(outliers)
    y, grad_x, grad_w, grad_b = _run(BLOCKWISE, x, weight, bias, grad_output)
    x2, g2 = x.reshape(150, 300), grad_output.reshape(150, 200)
    gemms = {  # name: (result, a, b, b's tile), each result = a @ b.T, a in 1x128 tiles
        "output": (y.double() - bias.double(), x2, weight, WEIGHT_BLOCK),
        "grad_input": (grad_x, g2, weight.t(), WEIGHT_BLOCK),
        "grad_weight": (grad_w, g2.t(), x2.t(), ACTIVATION_TILE),
    }
    for name, (result, a, b, b_tile) in gemms.items():
        slack = U32 * bias.double().abs() if name == "output" else 0.0  # the float32 bias add
        exact, bound = gemm_bound(a, b, E4M3, E4M3, BLOCKWISE, torch.float32, b_tile)
        assert_within(result, exact, bound + slack, f"{name} vs float64")
        sharp, sharp_bound = sharp_reference(a, b, E4M3, E4M3, BLOCKWISE, torch.float32, b_tile)
        assert_within(result, sharp, sharp_bound + 2 * slack, f"{name} vs the quantized operands")
        if not outliers:  # no element below E4M3's normal range: the closed-form recipe bound holds
            k = a.shape[1] + 3
            magnitude = a.double().abs() @ b.double().abs().T
            recipe_bound = (2 * _U + _U**2 + 10 * U32 + k * U32 / (1 - k * U32) * (1 + _U) ** 2) * magnitude
            assert_within(result, exact, recipe_bound + slack, f"{name} vs (2^-3 + 2^-8) sum |a||b|")
    assert_within(grad_b, g2.double().sum(0), 150 * U32 * g2.double().abs().sum(0), "grad_bias")


def test_blockwise_beats_tensorwise_next_to_outliers() -> None:
    """Away from the outliers' own tiles, BLOCKWISE keeps E4M3's 2^-4 while TENSORWISE's one scale, set by the
    outliers, pushes the ordinary values below E4M3's normal range (or to zero). Compared where no outlier enters the
    sum: output rows other than token 7, columns 0:128 (weight rows without the outlier block); grad_input's columns
    outside 128:256; grad_weight's columns other than channel 5."""
    x, weight, bias, grad_output = _linear_with_outliers(True)
    x2, g2 = x.double().reshape(150, 300), grad_output.double().reshape(150, 200)
    exact = [x2 @ weight.double().T, g2 @ weight.double(), g2.T @ x2]
    rows = torch.arange(150) != 7
    columns = torch.cat([torch.arange(128), torch.arange(256, 300)])
    clean = [
        lambda t: t[rows][:, :128],
        lambda t: t[:, columns],
        lambda t: t[:, torch.arange(300) != 5],
    ]
    errors = {}
    for recipe in (ScalingRecipe.TENSORWISE, BLOCKWISE):
        y, grad_x, grad_w, _ = _run(recipe, x, weight, bias, grad_output)
        results = [y.double().reshape(150, 200) - bias.double(), grad_x.double().reshape(150, 300), grad_w.double()]
        errors[recipe] = [
            ((pick(r) - pick(e)).norm() / pick(e).norm()).item()
            for r, e, pick in zip(results, exact, clean, strict=True)
        ]
    for name, blockwise, tensorwise in zip(
        ("output", "grad_input", "grad_weight"), errors[BLOCKWISE], errors[ScalingRecipe.TENSORWISE], strict=True
    ):
        assert blockwise < 2 * _U, f"{name}: BLOCKWISE's relative error {blockwise:.3g} next to the outliers"
        assert tensorwise > 10 * blockwise, f"{name}: TENSORWISE {tensorwise:.3g} vs BLOCKWISE {blockwise:.3g}"


def test_blockwise_through_fp8_options_and_convert() -> None:
    layer = nn.Linear(256, 144)
    assert convert_to_fp8(layer, Fp8Options(recipe=BLOCKWISE)) == [""]
    assert isinstance(layer, Fp8Linear)
    assert layer.recipe is BLOCKWISE
    assert "recipe=blockwise" in repr(layer)
    x = torch.randn(5, 256)
    assert torch.equal(layer(x), fp8_linear(x, layer.weight, layer.bias, BLOCKWISE))
