"""Step `fp8_linear`: cx's fp8 linear (cx_mesh.fp8.fp8_linear: E4M3 operands, torch._scaled_mm) on CUDA sm89+,
against the exact product of the same bf16 operands and against bf16 F.linear, for both scaling recipes; then its
throughput beside bf16's on large square GEMMs (reported, not judged).

The tolerance is derived, not measured: the forward bound of packages/mesh/tests/test_fp8_numerics.py. Quantizing x
under scale s (amax / 448) errs by e(x) = max(u|x|, s * tiny * u) + 3 u32 |x| (u = 2^-4, E4M3's unit roundoff; the
second term is the subnormal range; the last the float32 roundings around the cast); a product's terms add their
errors, e(a)|b| + |a|e(b) + e(a)e(b), with no cancellation assumed; the float32 accumulation adds gamma_(K+3) times
the sum of |a^ b^| (Higham 3.1), and writing the bf16 output one bf16 rounding. Every element must lie within it.

Without CUDA the same check runs on torch's CPU fp8 kernel where it has one (torch >= 2.13), so the script stays
tested where CI runs; the report says so. A GPU older than sm89 has no fp8 GEMMs: skipped.
"""

from __future__ import annotations

import torch

from cx_mesh.fp8 import ScalingRecipe, fp8_linear, fp8_matmul_supported
from gpu_check_step import Skip, run_step

TOKENS, IN_FEATURES, OUT_FEATURES = 512, 1024, 768
TIMED_SIZE, TIMED_ITERATIONS = 8192, 20
_U32 = torch.finfo(torch.float32).eps / 2


def _error_bound(values: torch.Tensor, recipe: ScalingRecipe) -> torch.Tensor:
    """e(x) of each element of a 2-D float64 operand quantized to E4M3 along its rows."""
    fp8 = torch.finfo(torch.float8_e4m3fn)
    per_row = recipe is ScalingRecipe.ROWWISE
    amax = values.abs().amax(-1, keepdim=True) if per_row else values.abs().amax()
    scale = (amax / fp8.max).clamp(min=torch.finfo(torch.float32).tiny)
    u = fp8.eps / 2
    return torch.maximum(u * values.abs(), scale * fp8.tiny * u) + 3 * _U32 * values.abs()


def _check(device: torch.device, recipe: ScalingRecipe) -> tuple[float, float, float]:
    """fp8_linear on `device` within the bound of the exact product; returns (largest error / bound, fp8's and
    bf16 F.linear's relative Frobenius error against the exact product)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, IN_FEATURES, generator=generator).bfloat16().to(device)
    weight = (torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator) / IN_FEATURES**0.5).bfloat16().to(device)
    out = fp8_linear(x, weight, None, recipe).double()
    plain = torch.nn.functional.linear(x, weight).double()
    a, b = x.double(), weight.double()
    exact = a @ b.T
    ea, eb = _error_bound(a, recipe), _error_bound(b, recipe)
    k = IN_FEATURES + 3
    before_output = ea @ b.abs().T + a.abs() @ eb.T + ea @ eb.T
    before_output += k * _U32 / (1 - k * _U32) * ((a.abs() + ea) @ (b.abs() + eb).T)
    bound = before_output + torch.finfo(torch.bfloat16).eps / 2 * (exact.abs() + before_output)
    if not torch.isfinite(out).all():
        raise AssertionError(f"{recipe}: non-finite outputs")
    used = float(((out - exact).abs() / bound).max())
    if used > 1:
        raise AssertionError(f"{recipe}: an element is off by {used:.2f} times the derived bound")
    norm = float(exact.norm())
    return used, float((out - exact).norm()) / norm, float((plain - exact).norm()) / norm


def _throughput(device: torch.device) -> str:
    """bf16 F.linear's and fp8_linear's (dynamic scaling included) TFLOP/s on one square GEMM."""
    x = torch.randn(TIMED_SIZE, TIMED_SIZE, device=device, dtype=torch.bfloat16)
    weight = torch.randn(TIMED_SIZE, TIMED_SIZE, device=device, dtype=torch.bfloat16)
    rates = []
    for run in (lambda: torch.nn.functional.linear(x, weight), lambda: fp8_linear(x, weight)):
        for _ in range(3):
            run()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(TIMED_ITERATIONS):
            run()
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / TIMED_ITERATIONS
        rates.append(2 * TIMED_SIZE**3 / seconds / 1e12)
    return f"{TIMED_SIZE}^3 GEMM: bf16 {rates[0]:.0f} TFLOP/s, fp8 {rates[1]:.0f} TFLOP/s ({rates[1] / rates[0]:.2f}x)"


def main() -> str:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if not fp8_matmul_supported("cuda"):
            raise Skip(f"{torch.cuda.get_device_name()} is sm{major}{minor}; fp8 GEMMs need sm89 or newer")
        device = torch.device("cuda")
        where = f"{torch.cuda.get_device_name()} (sm{major}{minor})"
    elif fp8_matmul_supported("cpu"):
        device, where = torch.device("cpu"), "CPU kernel only (no CUDA here: the sm89+ check did not run)"
    else:
        raise Skip(f"no CUDA and torch {torch.__version__} has no CPU fp8 kernel")
    parts = [where]
    with torch.no_grad():
        for recipe in ScalingRecipe:
            used, fp8_error, bf16_error = _check(device, recipe)
            parts.append(
                f"{recipe.value}: within the bound (worst element {used:.0%} of it), relative error fp8 "
                f"{fp8_error:.1e} vs bf16 {bf16_error:.1e}"
            )
        if device.type == "cuda":
            parts.append(_throughput(device))
    return "; ".join(parts)


if __name__ == "__main__":
    run_step(main)
