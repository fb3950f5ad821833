"""fp8 numerics: quantize's error, and fp8_linear's forward and both gradients against a float64 reference.

The bound (derived, not measured). Quantizing a value x under scale s (amax / fp8 max, at least 2^-126) rounds x / s
to the nearest fp8 number: off by at most u|x| in the normal range (u = 2^-4 for E4M3, 2^-3 for E5M2, the formats'
unit roundoff) and by half the subnormal spacing, s * tiny * u, below it. So e(x) = max(u|x|, s * tiny * u), plus 3
u32 |x| for the float32 roundings around the cast, bounds |x^ - x| per element. One term of a dot product of length
K then errs by |a^ b^ - a b| <= e(a)|b| + |a|e(b) + e(a)e(b), and the K terms' errors add (deterministically; no
cancellation assumed). torch._scaled_mm accumulates in float32 and multiplies by the two scales: at most (K + 3)
float32 roundings, gamma_(K+3) * sum|a^ b^| with gamma_n = n u32 / (1 - n u32) (Higham 3.1; the + 3 covers the
scales and the bias add). Writing the output in its dtype rounds once more: u_out (|y| + the bound so far). Each
GEMM quantizes its operands along the reduction dim, one scale per tensor (TENSORWISE), per row of each operand
(ROWWISE) or per tile (BLOCKWISE: 1x128 tiles of activations and gradients, 128x128 blocks of weights; its emulated
GEMM multiplies the float32-dequantized operands in float32, K roundings, within the same gamma), so the bound is
computed with the same scales (fp8_bound_helpers, which recomputes them tile by tile).
A second, sharper check recomputes each GEMM in float64 from cx's own quantized operands: only the float32
accumulation and the output rounding separate the two, which pins down scales and layouts exactly.
"""

from __future__ import annotations

import pytest
import torch

from cx_mesh.fp8 import (
    ACTIVATION_TILE,
    E4M3,
    E5M2,
    WEIGHT_BLOCK,
    ScalingRecipe,
    fp8_linear,
    fp8_matmul_supported,
    quantize,
)
from cx_mesh.testing import unit_roundoff
from fp8_bound_helpers import U32, assert_within, element_bound, gemm_bound, sharp_reference

_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _grad_dtype(recipe: ScalingRecipe) -> torch.dtype:
    """The gradient's format: E5M2, E4M3 with BLOCKWISE (DeepSeek-V3's recipe)."""
    return E4M3 if recipe is ScalingRecipe.BLOCKWISE else E5M2


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("recipe", list(ScalingRecipe))
@pytest.mark.parametrize("dtype", _DTYPES)
def test_fp8_quantize_error_within_unit_roundoff(
    fp8_dtype: torch.dtype, recipe: ScalingRecipe, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(0)
    values = (torch.randn(3, 4, 32, generator=generator) * torch.logspace(-3, 3, 32)).to(dtype)
    quantized = quantize(values, fp8_dtype, recipe)
    assert quantized.data.dtype == fp8_dtype
    assert quantized.data.shape == values.shape
    assert quantized.scale.shape == (() if recipe is ScalingRecipe.TENSORWISE else (12, 1))  # 32 < one 1x128 tile
    restored = quantized.dequantize(dtype)
    assert restored.dtype == dtype
    flat = values.double().reshape(12, 32)
    bound = element_bound(flat, fp8_dtype, recipe)
    assert_within(quantized.dequantize(torch.float64), flat, bound, "quantize")


@pytest.mark.parametrize("recipe", list(ScalingRecipe))
def test_fp8_quantize_zero_huge_tiny_and_non_finite(recipe: ScalingRecipe) -> None:
    zeros = quantize(torch.zeros(4, 16), E4M3, recipe)
    assert torch.equal(zeros.dequantize(), torch.zeros(4, 16))
    assert torch.isfinite(zeros.scale).all()
    assert (zeros.scale > 0).all()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        info = torch.finfo(dtype)
        for magnitude in (info.max, info.tiny):  # near the dtype's largest and smallest normal numbers
            values = (torch.linspace(-1, 1, 64) * magnitude).to(dtype).reshape(4, 16)
            bound = element_bound(values.double(), E5M2, recipe)
            assert_within(quantize(values, E5M2, recipe).dequantize(torch.float64), values.double(), bound, "range")
    for bad in (float("inf"), float("nan")):
        values = torch.ones(4, 16)
        values[1, 3] = bad
        restored = quantize(values, E4M3, recipe).dequantize()
        assert not torch.isfinite(restored[1]).any()  # the whole scale group is poisoned, so a check sees it
        if recipe is not ScalingRecipe.TENSORWISE:
            assert torch.equal(restored[0], torch.ones(16))


@pytest.mark.parametrize("recipe", list(ScalingRecipe))
@pytest.mark.parametrize("dtype", _DTYPES)
def test_fp8_linear_forward_and_gradients_within_fp8_bounds(recipe: ScalingRecipe, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 24, 64, generator=generator).to(dtype).requires_grad_()  # 48 tokens, leading dims
    weight = (torch.randn(32, 64, generator=generator) / 8).to(dtype).requires_grad_()
    bias = torch.randn(32, generator=generator).to(dtype).requires_grad_()
    grad_output = torch.randn(2, 24, 32, generator=generator).to(dtype)
    y = fp8_linear(x, weight, bias, recipe)
    y.backward(grad_output)
    assert y.dtype == dtype
    assert x.grad is not None
    assert weight.grad is not None
    assert bias.grad is not None
    assert (x.grad.dtype, weight.grad.dtype, bias.grad.dtype) == (dtype, dtype, dtype)
    x2, g2, w = x.detach().reshape(48, 64), grad_output.reshape(48, 32), weight.detach()
    g8 = _grad_dtype(recipe)
    gemms = {  # name: (result, a, b, a's format, b's format, b's BLOCKWISE tile), each result = a @ b.T
        "output": (y.detach().double() - bias.detach().double(), x2, w, E4M3, E4M3, WEIGHT_BLOCK),
        "grad_input": (x.grad, g2, w.t(), g8, E4M3, WEIGHT_BLOCK),
        "grad_weight": (weight.grad, g2.t(), x2.t(), g8, E4M3, ACTIVATION_TILE),
    }
    for name, (result, a, b, a_dtype, b_dtype, b_tile) in gemms.items():
        # the bias is added in float32 and rounded with the output: count that rounding on the output's bound
        slack = unit_roundoff(dtype) * bias.detach().double().abs() if name == "output" else 0.0
        exact, bound = gemm_bound(a, b, a_dtype, b_dtype, recipe, dtype, b_tile)
        assert_within(result, exact, bound + slack, f"{name} vs float64")
        sharp, sharp_bound = sharp_reference(a, b, a_dtype, b_dtype, recipe, dtype, b_tile)
        assert_within(result, sharp, sharp_bound + 2 * slack, f"{name} vs the quantized operands")
    exact_bias = g2.double().sum(0)
    bias_bound = 48 * U32 * g2.double().abs().sum(0) + unit_roundoff(dtype) * exact_bias.abs() * 1.01
    assert_within(bias.grad, exact_bias, bias_bound, "grad_bias")


def test_fp8_linear_zero_huge_tiny_and_non_finite_inputs() -> None:
    weight = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    zeros = torch.zeros(4, 32, requires_grad=True)
    w = weight.clone().requires_grad_()
    out = fp8_linear(zeros, w)
    out.backward(torch.ones_like(out))
    assert torch.equal(out, torch.zeros(4, 16))
    assert w.grad is not None
    assert torch.equal(w.grad, torch.zeros(16, 32))  # g^T @ 0, no 0/0
    # huge activations against tiny weights (products of order 1): the scales keep every operand in range
    for x_scale, w_scale, dtype in (
        (1e37, 1e-37, torch.float32),
        (1e37, 1e-36, torch.bfloat16),
        (1e-36, 1e30, torch.float32),
    ):
        x = (torch.randn(4, 32, generator=torch.Generator().manual_seed(3)) * x_scale).to(dtype)
        scaled_weight = (weight * w_scale).to(dtype)
        exact, bound = gemm_bound(x, scaled_weight, E4M3, E4M3, ScalingRecipe.TENSORWISE, dtype)
        assert_within(fp8_linear(x, scaled_weight), exact, bound, f"x ~ {x_scale}, w ~ {w_scale}")
    for recipe in ScalingRecipe:
        poisoned = torch.ones(4, 32)
        poisoned[2, 5] = float("inf")
        out = fp8_linear(poisoned, weight, recipe=recipe)
        assert not torch.isfinite(out[2]).any()


def test_fp8_linear_refuses_unsupported_inputs_and_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(16, 32)
    with pytest.raises(TypeError, match="float64"):
        fp8_linear(torch.randn(4, 32, dtype=torch.float64), weight)
    with pytest.raises(ValueError, match="in_features 32"):
        fp8_linear(torch.randn(4, 16), weight)
    with pytest.raises(ValueError, match="2-D"):
        fp8_linear(torch.randn(4, 32), weight[None])
    with pytest.raises(RuntimeError, match="'meta'"):
        fp8_linear(torch.randn(4, 32, device="meta"), weight.to("meta"))
    assert fp8_matmul_supported("cpu")
    assert not fp8_matmul_supported("meta")
    # a CUDA device below sm89 (an A100) is refused by name and capability, never run in high precision
    from cx_mesh.fp8 import _matmul

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    assert not fp8_matmul_supported("cuda:0")
    with pytest.raises(RuntimeError, match=r"A100\) has compute capability 8\.0.*8\.9 or newer"):
        _matmul._require_supported(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_matmul_supported("cuda:0")
    # CUDA's row-wise kernels take E5M2 only as the left operand (where fp8_linear's backward puts the gradient):
    # refused on CPU too, so a CPU run catches an operand order CUDA would reject
    with pytest.raises(ValueError, match="ROWWISE takes an E4M3 right operand"):
        _matmul.scaled_matmul(weight, weight, E4M3, E5M2, ScalingRecipe.ROWWISE, torch.float32)
    assert _matmul.scaled_matmul(weight, weight, E5M2, E4M3, ScalingRecipe.ROWWISE, torch.float32).shape == (16, 16)
    # BLOCKWISE is DeepSeek-V3's all-E4M3 recipe: an E5M2 operand is a caller's mistake, refused
    with pytest.raises(ValueError, match="BLOCKWISE takes E4M3 operands"):
        _matmul.scaled_matmul(weight, weight, E5M2, E4M3, ScalingRecipe.BLOCKWISE, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fp8_matmul_supported("cuda")), reason="needs CUDA sm89+")
@pytest.mark.parametrize("recipe", list(ScalingRecipe))
def test_fp8_linear_on_cuda_matches_the_cpu_result(recipe: ScalingRecipe) -> None:
    """Both devices quantize to the same fp8 operands; cuBLASLt sums them in another order (and, for ROWWISE, rounds
    its output to bf16 before the bias is added), so the results agree within the sharp bound above, twice over
    (each device within it of the same float64 value), plus one bf16 rounding for ROWWISE, plus, for the forward
    output, each device's rounding of the bias add (the sharp bound counts a^ b^ alone): u32 |a^ b^ + bias| <= u32
    (|a^ b^| + |bias|) each. 40 features and 24 tokens are not multiples of 16: the CUDA path pads them."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(3, 8, 40, generator=generator)
    weight, bias = torch.randn(24, 40, generator=generator), torch.randn(24, generator=generator)
    grad_output = torch.randn(3, 8, 24, generator=generator)
    results = {}
    for device in ("cpu", "cuda"):
        leaves = [t.to(device).requires_grad_() for t in (x, weight, bias)]
        out = fp8_linear(leaves[0], leaves[1], leaves[2], recipe)
        out.backward(grad_output.to(device))
        results[device] = [out.detach().cpu()] + [leaf.grad.cpu() for leaf in leaves if leaf.grad is not None]
    x2, g2, g8 = x.reshape(24, 40), grad_output.reshape(24, 24), _grad_dtype(recipe)
    gemms = [
        (x2, weight, E4M3, E4M3, WEIGHT_BLOCK),
        (g2, weight.t(), g8, E4M3, WEIGHT_BLOCK),
        (g2.t(), x2.t(), g8, E4M3, ACTIVATION_TILE),
    ]
    for i, (cpu, cuda, (a, b, a_dtype, b_dtype, b_tile)) in enumerate(
        zip(results["cpu"], results["cuda"], gemms, strict=False)
    ):
        reference, bound = sharp_reference(a, b, a_dtype, b_dtype, recipe, torch.float32, b_tile)
        slack = unit_roundoff(torch.bfloat16) * (reference.abs() + bound) if recipe is ScalingRecipe.ROWWISE else 0.0
        bias_add = 2 * U32 * (reference.abs() + bias.double().abs()) if i == 0 else 0.0  # the output's bias
        assert_within(cuda, cpu.double().reshape(reference.shape), 2 * bound + slack + bias_add, "cuda vs cpu")
    sum_bound = 2 * 24 * U32 * g2.double().abs().sum(0)  # grad_bias: two orders of a float32 sum of 24 terms
    assert_within(results["cuda"][3], results["cpu"][3].double(), sum_bound, "grad_bias cuda vs cpu")
