"""enable_sequence_overlap with use_fp8 / fp8_communication at 2 and 4 ranks: split_gather column and row layers
(nn.Linear and GPT-2 Conv1D) computed by the overlap ring against the same layers, same fp8 switches, without
overlap, forward and backward, for each recipe; and the bytes a ring step sends with fp8_communication (tp 2).
Measured: at most 13% of the bound at tp 2, 9% at tp 4 (the fp8-wire sums).

Tolerance from the arithmetic. An fp8 rounding of v (dynamic scaling, scale s = amax / fmax of its group) is off by
at most u |v| + t amax: u the unit roundoff, 2^-4 for E4M3 (3 mantissa bits) and 2^-3 for E5M2 (2 bits), and t amax
half the smallest subnormal's spacing times the scale (t = 2^-10 / 448 for E4M3, 2^-17 / 57344 for E5M2), which
bounds the rounding of an element below the normal range; plus 3 float32 roundings of v (v / s before the cast, the
scale, the dequantizing product: mesh's fp8_bound_helpers.element_bound). So one fp8 GEMM of a (M, K) and b (K, N)
is off the exact a @ b by at most (ua + ub + ua ub) |a| @ |b| + (1 + ua) tb max|b| rowsum|a| + (1 + ub) ta max|a|
colsum|b| + K ta max|a| tb max|b| (`_gemm`: |q(a) q(b) - ab| <= |q(a) - a| |q(b)| + |a| |q(b) - b|, summed over K).
The overlapped and the plain path each stay within that of the exact product of the same operands, so they differ by
twice it. Their operands are the same: a gathered chunk travels as fp8 quantized once by its owner (bitwise the
plain fp8 all-gather's values), and the weight gradient is one GEMM of the same full tensors either way. Forward
GEMMs take E4M3 operands; backward GEMMs an E5M2 gradient (E4M3 with BLOCKWISE) and an E4M3 weight or activation. A
summed output (the column layer's input gradient, the row layer's output) also carries its fp8 wire rounding: the
plain reduce-scatter quantizes every rank's part once, the ring the partial sum it sends on each of its tp - 1 hops
(at tp 4 three re-quantizations, each of a sum carrying the earlier hops' errors: `_wire_sums`), each at most
u |v| + t max|v|, the parts bounded by the GEMM's magnitude plus its error. An fp8_communication gather feeds the GEMM
values off by at most u |v| + t amax (`_wired`). The float32 accumulation adds at most `sum_tolerance` of the
reduced dimension.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.fp8 import ScalingRecipe
from cx_mesh.testing import count_collective_bytes, distributed, sum_tolerance, unit_roundoff
from cx_shardformer import Linear1D_Col, Linear1D_Row
from cx_shardformer._conv1d import GPT2FusedLinearConv1D_Col, GPT2FusedLinearConv1D_Row
from cx_shardformer._overlap import RING_RECIPES, check_overlap_layer
from shardformer_helpers import GPT2Conv1D, chunk

B, S, IN, OUT = 2, 8, 32, 64  # fp8-eligible shards: every local dim a multiple of 16
U4, T4 = 2.0**-4, 2.0**-10 / 448.0  # E4M3: unit roundoff; half the smallest subnormal over the largest value
U5, T5 = 2.0**-3, 2.0**-17 / 57344.0  # E5M2
F32_ROUNDINGS = 3 * unit_roundoff(torch.float32)  # of each quantized element, on top of its fp8 rounding
NO_FP8 = (0.0, 0.0)
CASES: list[tuple[ScalingRecipe | None, bool]] = [
    (ScalingRecipe.TENSORWISE, False),
    (ScalingRecipe.TENSORWISE, True),
    (ScalingRecipe.ROWWISE, True),
    (ScalingRecipe.BLOCKWISE, True),
    (None, True),  # fp8_communication alone: high-precision GEMMs, fp8 wire
]


def _gemm(a: torch.Tensor, b: torch.Tensor, fa: tuple[float, float], fb: tuple[float, float]) -> torch.Tensor:
    """One path's fp8 GEMM error bound against the exact a @ b, from |a| (M, K), |b| (K, N) and each operand's
    (u, t) (`NO_FP8`: not quantized)."""
    (ua, ta), (ub, tb) = fa, fb
    ua, ub = (u + F32_ROUNDINGS if u else 0.0 for u in (ua, ub))
    ta, tb = ta * float(a.max()), tb * float(b.max())
    rows, cols = a.sum(-1, keepdim=True), b.sum(0, keepdim=True)
    return (ua + ub + ua * ub) * (a @ b) + (1 + ua) * tb * rows + (1 + ub) * ta * cols + a.shape[-1] * ta * tb


def _wired(v: torch.Tensor, fmt: tuple[float, float]) -> torch.Tensor:
    """A magnitude bound of |v| after an fp8 wire rounding in `fmt` (`NO_FP8`: none)."""
    u, t = fmt
    u = u + F32_ROUNDINGS if u else 0.0
    return (1 + u) * v + t * float(v.max())


def _tolerance(
    a: torch.Tensor,
    b: torch.Tensor,
    fa: tuple[float, float],
    fb: tuple[float, float],
    wire: tuple[float, float],
    bias: float = 0.0,
    world: int = 2,
) -> torch.Tensor:
    """Overlapped vs plain: twice one GEMM's bound; for a summed output sent in `wire`, both paths' wire rounding
    (`_wire_sums`, the parts' sum bounded by |a| @ |b| plus the GEMM's error); and float32 accumulation of K terms
    and a `bias`."""
    magnitude = a @ b
    gemm = _gemm(a, b, fa, fb)
    rounding = sum_tolerance(a.shape[-1] + 1, float(magnitude.max()) + bias)
    return 2 * gemm + _wire_sums(magnitude + gemm, wire, world) + rounding


def _wire_sums(parts: torch.Tensor, wire: tuple[float, float], world: int) -> torch.Tensor:
    """Both paths' fp8 wire rounding of a sum of `world` parts whose magnitudes add up to at most `parts`. The plain
    reduce-scatter quantizes each part once: u sum|p_i| + world t max|p| <= u parts + world t max(parts). The ring
    re-quantizes the partial sum it passes on at each of its world - 1 hops: hop j sends s_j, j parts plus the
    errors e_1..e_(j-1) of the earlier hops, |s_j| <= parts + sum_(i<j) e_i, and adds e_j <= u |s_j| + t max|s_j|
    (the errors compound: each re-quantized sum carries the earlier roundings). At tp 2 the sum is u parts + t
    max(parts) + the plain's u parts + 2 t max(parts): 2 u parts + 3 t max(parts)."""
    u, t = wire
    if not u:
        return torch.zeros_like(parts)
    u = u + F32_ROUNDINGS
    plain = u * parts + world * t * float(parts.max())
    ring = torch.zeros_like(parts)
    for _hop in range(world - 1):
        sent = parts + ring
        ring = ring + u * sent + t * float(sent.max())
    return plain + ring


def _within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shapes {actual.shape} vs {expected.shape}"
    excess = float(((actual - expected).abs() - bound.reshape(expected.shape)).max())
    assert excess <= 0, f"{what}: overlapped and plain differ beyond the fp8 bound by {excess:.3g}"


def _layers(kind: str, col_in: int, col_out: int, recipe: ScalingRecipe | None, wire: bool) -> tuple[Any, Any, Any]:
    """(plain, overlapped) copies of one split_gather layer with the fp8 switches set (as `apply_fp8` sets them), and
    its full [out, in] weight."""
    torch.manual_seed(0)
    native: nn.Module
    if kind.startswith("linear"):
        native = nn.Linear(col_in, col_out)
        weight = native.weight.detach().clone()
        layer_class: Any = Linear1D_Col if kind == "linear_col" else Linear1D_Row
    else:
        native = GPT2Conv1D(col_out, col_in)
        weight = native.weight.detach().t().clone()
        layer_class = GPT2FusedLinearConv1D_Col if kind == "conv_col" else GPT2FusedLinearConv1D_Row
    twin = copy.deepcopy(native)
    plain = layer_class.from_native_module(native, None, seq_parallel_mode="split_gather")
    overlapped = layer_class.from_native_module(twin, None, seq_parallel_mode="split_gather")
    overlapped.sequence_overlap = True
    for layer in (plain, overlapped):
        layer.fp8_recipe, layer.fp8_communication = recipe, wire
    return plain, overlapped, weight


def _run(layer: Any, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * grad).sum().backward()
    assert x.grad is not None
    assert layer.weight.grad is not None
    return out.detach(), x.grad, layer.weight.grad


def _formats(recipe: ScalingRecipe | None) -> tuple[tuple[float, float], tuple[float, float]]:
    """(forward operand, gradient) fp8 formats of the GEMMs."""
    if recipe is None:
        return NO_FP8, NO_FP8
    return (U4, T4), ((U4, T4) if recipe is ScalingRecipe.BLOCKWISE else (U5, T5))


def _same_weight_grad(got: torch.Tensor, ref: torch.Tensor, recipe: ScalingRecipe | None, what: str) -> None:
    """With a recipe both paths take the weight gradient as one `fp8_linear_weight_grad` of the same full tensors
    (the gathered input or output gradient equals the plain fp8 all-gather's bit for bit): equal exactly, which a
    ring falling back to a high-precision backward would break."""
    if recipe is not None:
        assert torch.equal(got, ref), f"{what}: the weight gradient differs from the plain fp8 path's"


def _check_column(prefix: str, recipe: ScalingRecipe | None, wire: bool, rank: int, world: int) -> None:
    plain, overlapped, weight = _layers(f"{prefix}_col", IN, OUT, recipe, wire)
    torch.manual_seed(1)
    x, g = torch.randn(B, S, IN), torch.randn(B, S, OUT)
    x_in, g_out = chunk(x, 1, rank, world), chunk(g, -1, rank, world)
    ref, got = _run(plain, x_in, g_out), _run(overlapped, x_in, g_out)
    fwd, grad = _formats(recipe)
    what = f"{prefix} column {recipe} wire={wire}"
    x_abs = _wired(x.abs(), (U4, T4) if wire else NO_FP8).reshape(B * S, IN)  # gathered through the fp8 wire
    w_local = chunk(weight, 0, rank, world).abs()
    bias = float(plain.bias.abs().max())
    _within(got[0], ref[0], _tolerance(x_abs, w_local.t(), fwd, fwd, NO_FP8, bias), f"{what} output")
    g_abs = g.abs().reshape(B * S, OUT)  # every rank's output-gradient slice feeds the summed input gradient
    sent = (U5, T5) if wire else NO_FP8
    bound = _own(_tolerance(g_abs, weight.abs(), grad, fwd, sent, world=world), rank, world)
    _within(got[1], ref[1], bound, f"{what} input grad")
    g_mine = g_out.abs().reshape(B * S, -1)
    _within(got[2], ref[2], _weight_layout(_tolerance(g_mine.t(), x_abs, grad, fwd, NO_FP8), prefix), f"{what} w")
    _same_weight_grad(got[2], ref[2], recipe, what)


def _check_row(prefix: str, recipe: ScalingRecipe | None, wire: bool, rank: int, world: int) -> None:
    plain, overlapped, weight = _layers(f"{prefix}_row", OUT, IN, recipe, wire)
    torch.manual_seed(2)
    y, h = torch.randn(B, S, OUT), torch.randn(B, S, IN)
    y_in, h_out = chunk(y, -1, rank, world), chunk(h, 1, rank, world)
    ref, got = _run(plain, y_in, h_out), _run(overlapped, y_in, h_out)
    fwd, grad = _formats(recipe)
    what = f"{prefix} row {recipe} wire={wire}"
    y_abs = y.abs().reshape(B * S, OUT)  # every rank's feature slice feeds the summed output
    sent = (U4, T4) if wire else NO_FP8
    bound = _tolerance(y_abs, weight.abs().t(), fwd, fwd, sent, float(plain.bias.abs().max()), world)
    _within(got[0], ref[0], _own(bound, rank, world), f"{what} output")
    h_abs = _wired(h.abs(), (U5, T5) if wire else NO_FP8).reshape(B * S, IN)  # gathered through the fp8 wire
    w_local = chunk(weight, 1, rank, world).abs()
    _within(got[1], ref[1], _tolerance(h_abs, w_local, grad, fwd, NO_FP8), f"{what} input grad")
    y_mine = y_in.abs().reshape(B * S, -1)
    _within(got[2], ref[2], _weight_layout(_tolerance(h_abs.t(), y_mine, grad, fwd, NO_FP8), prefix), f"{what} w")
    _same_weight_grad(got[2], ref[2], recipe, what)


def _own(bound: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's sequence shard of a bound over every (batch, position) row."""
    return chunk(bound.reshape(B, S, -1), 1, rank, world)


def _weight_layout(bound: torch.Tensor, prefix: str) -> torch.Tensor:
    """A weight-gradient bound computed [out, in], in the layer's own layout (Conv1D: [in, out])."""
    return bound if prefix == "linear" else bound.t()


@distributed(world_size=2)
def test_shardformer_overlap_fp8_layers_match_plain_fp8(rank: int, world_size: int) -> None:
    for recipe, wire in CASES:
        for prefix in ("linear", "conv"):
            _check_column(prefix, recipe, wire, rank, world_size)
            _check_row(prefix, recipe, wire, rank, world_size)


@distributed(world_size=4, timeout=300)
def test_shardformer_overlap_fp8_layers_match_plain_fp8_tp4(rank: int, world_size: int) -> None:
    """A 4-rank ring: a gathered chunk still travels quantized once (3 hops, passed on unchanged), but a ring sum
    re-quantizes its partial sum on each of 3 hops, checked within `_wire_sums`'s 3-hop bound (not tp 2's)."""
    for recipe, wire in CASES:
        for prefix in ("linear", "conv"):
            _check_column(prefix, recipe, wire, rank, world_size)
            _check_row(prefix, recipe, wire, rank, world_size)


@distributed(world_size=2)
def test_shardformer_overlap_fp8_ring_step_bytes(rank: int, world_size: int) -> None:
    """A ring step hands over one chunk each way (batch_isend_irecv counts the send and the receive buffer): in bf16
    2 bytes an element; with fp8_communication one byte an element plus the 4-byte float32 scale, so half of bf16's
    plus 8 bytes a step. tp 2: each ring is one step (column forward gather, its backward sum; row forward sum, its
    backward gather), four per column-row pair. The row bias's gradient sum (an all-reduce) is the same either way."""
    counts = []
    for wire in (False, True):
        column = _layers("linear_col", IN, OUT, ScalingRecipe.TENSORWISE, wire)[1].to(torch.bfloat16)
        row = _layers("linear_row", OUT, IN, ScalingRecipe.TENSORWISE, wire)[1].to(torch.bfloat16)
        x = torch.randn(B, S // world_size, IN, dtype=torch.bfloat16, requires_grad=True)
        with count_collective_bytes() as counted:
            row(column(x)).float().sum().backward()
        counts.append(counted)
    plain, fp8 = counts
    others = [{k: v for k, v in c.by_dtype.items() if k[0] != "batch_isend_irecv"} for c in counts]
    assert others[0] == others[1], others
    chunk_numel = B * (S // world_size) * IN  # the column's input chunk, the row's output chunk and their gradients
    steps = 4
    ring = "batch_isend_irecv"
    assert {k: v for k, v in plain.by_dtype.items() if k[0] == ring} == {
        (ring, torch.bfloat16): steps * 2 * 2 * chunk_numel
    }
    assert {k: v for k, v in fp8.by_dtype.items() if k[0] == ring} == {
        (ring, torch.uint8): steps * 2 * (chunk_numel + 4)
    }
    assert fp8.calls[ring, torch.uint8] == steps
    assert fp8.by_op[ring] == plain.by_op[ring] // 2 + steps * 2 * 4, "half of bf16 plus a scale each way a step"


def test_shardformer_overlap_fp8_recipe_refusal() -> None:
    """Every recipe cx has runs in the ring; anything else is refused by name."""
    assert set(RING_RECIPES) == set(ScalingRecipe)

    class _Layer:
        fp8_recipe = "mxfp8"
        gather_output = False

    with pytest.raises(ValueError, match="fp8 recipe mxfp8, which the overlap ring does not implement"):
        check_overlap_layer(_Layer(), "column")


@distributed(world_size=1)
def test_shardformer_overlap_fp8_one_rank_is_exact(rank: int, world_size: int) -> None:
    """One rank sends nothing, so nothing is quantized for the wire (as cx_mesh.fp8's collectives copy exactly):
    with fp8_communication alone the ring computes exactly what the plain layer does."""
    torch.manual_seed(3)
    x, g = torch.randn(B, S, IN), torch.randn(B, S, OUT)
    plain, overlapped, _ = _layers("linear_col", IN, OUT, None, True)
    for got, ref in zip(_run(overlapped, x, g), _run(plain, x, g), strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
