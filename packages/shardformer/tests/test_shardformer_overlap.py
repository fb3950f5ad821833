"""enable_sequence_overlap at 2 ranks: split_gather column and row layers (nn.Linear and GPT-2 Conv1D) computed by the
overlap ring against the plain all-gather / reduce-scatter, forward and backward; ShardConfig's rules for the switch.

Tolerance from the arithmetic: every output and gradient element is the same dot product either way (the matmul is
split along the sequence, its rows) and the ring adds the ranks' partial sums in another order than the collective,
so each element agrees within `sum_tolerance` of its reduced dimension (it is usually bitwise equal: a GEMM kernel
rarely changes its summation order with the row count, and two partial sums add in either order alike).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed, sum_tolerance
from cx_shardformer import Linear1D_Col, Linear1D_Row, ShardConfig, ShardFormer
from cx_shardformer._conv1d import GPT2FusedLinearConv1D_Col, GPT2FusedLinearConv1D_Row
from shardformer_helpers import GPT2Conv1D, chunk

B, S, IN, OUT = 2, 8, 16, 24


def _within(actual: torch.Tensor, expected: torch.Tensor, n_terms: int, magnitude: torch.Tensor, what: str) -> None:
    """`magnitude`: the sums of |terms| (an upper bound of them); its largest entry sets the bound."""
    bound = sum_tolerance(n_terms, float(magnitude.max()))
    error = float((actual - expected).abs().max())
    assert actual.shape == expected.shape, f"{what}: shapes {actual.shape} vs {expected.shape}"
    assert error <= bound, f"{what}: overlapped and plain differ by {error:.3g} > {bound:.3g}"


def _layers(kind: str, col_in: int, col_out: int, rank: int) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """(plain, overlapped) copies of one split_gather layer and its full weight / bias in [out, in] layout."""
    torch.manual_seed(0)
    native: nn.Module
    if kind.startswith("linear"):
        linear = nn.Linear(col_in, col_out)
        native, weight, bias = linear, linear.weight.detach().clone(), linear.bias.detach().clone()
        layer_class: Any = Linear1D_Col if kind == "linear_col" else Linear1D_Row
    else:
        conv = GPT2Conv1D(col_out, col_in)
        native, weight, bias = conv, conv.weight.detach().t().clone(), conv.bias.detach().clone()
        layer_class = GPT2FusedLinearConv1D_Col if kind == "conv_col" else GPT2FusedLinearConv1D_Row
    twin = copy.deepcopy(native)
    plain = layer_class.from_native_module(native, None, seq_parallel_mode="split_gather")
    overlapped = layer_class.from_native_module(twin, None, seq_parallel_mode="split_gather")
    overlapped.sequence_overlap = True
    return plain, overlapped, weight, bias


def _run(layer: Any, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * grad).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad, [p.grad for p in (layer.weight, layer.bias)]


@distributed(world_size=2)
def test_shardformer_overlap_layers_match_plain(rank: int, world_size: int) -> None:
    tokens = B * S
    for prefix in ("linear", "conv"):
        # column: this rank's sequence shard in, this rank's feature slice of the full sequence out
        plain, overlapped, weight, bias = _layers(f"{prefix}_col", IN, OUT, rank)
        torch.manual_seed(1)
        x, g = torch.randn(B, S, IN), torch.randn(B, S, OUT)
        x_in, g_out = chunk(x, 1, rank, world_size), chunk(g, -1, rank, world_size)
        w_local = chunk(weight, 0, rank, world_size)
        ref, got = _run(plain, x_in, g_out), _run(overlapped, x_in, g_out)
        what = f"{prefix} column"
        _within(got[0], ref[0], IN + 1, x.abs() @ w_local.abs().t() + bias.abs().max(), f"{what} output")
        _within(got[1], ref[1], OUT, g.abs() @ weight.abs(), f"{what} input grad")
        g_abs, x_abs = g_out.abs().reshape(tokens, -1), x.abs().reshape(tokens, -1)
        _within(got[2][0], ref[2][0], tokens, g_abs.t() @ x_abs, f"{what} w grad")
        _within(got[2][1], ref[2][1], tokens, g_abs.sum(0), f"{what} bias grad")

        # row: this rank's feature slice of the full sequence in, the summed output's sequence shard out
        plain, overlapped, weight, bias = _layers(f"{prefix}_row", OUT, IN, rank)
        torch.manual_seed(2)
        y, h = torch.randn(B, S, OUT), torch.randn(B, S, IN)
        y_in, h_out = chunk(y, -1, rank, world_size), chunk(h, 1, rank, world_size)
        ref, got = _run(plain, y_in, h_out), _run(overlapped, y_in, h_out)
        what = f"{prefix} row"
        w_local = chunk(weight, 1, rank, world_size)
        _within(got[0], ref[0], OUT + 1, y.abs() @ weight.abs().t() + bias.abs().max(), f"{what} output")
        _within(got[1], ref[1], IN, h.abs() @ w_local.abs(), f"{what} input grad")
        h_abs, y_abs = h.abs().reshape(tokens, -1), chunk(y, -1, rank, world_size).abs().reshape(tokens, -1)
        _within(got[2][0], ref[2][0], tokens, h_abs.t() @ y_abs, f"{what} w grad")
        _within(got[2][1], ref[2][1], tokens, h_abs.sum(0), f"{what} bias grad")


def test_shardformer_overlap_config_rules() -> None:
    with pytest.raises(ValueError, match=r"enable_sequence_overlap overlaps split_gather.*'off'"):
        ShardConfig(enable_sequence_overlap=True)
    for mode in ("all_to_all", "ring"):
        with pytest.raises(ValueError, match=rf"enable_sequence_overlap overlaps split_gather.*'{mode}'"):
            ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode=mode, enable_sequence_overlap=True)
    sequence: dict[str, Any] = {"enable_sequence_parallelism": True, "sequence_parallelism_mode": "split_gather"}
    assert ShardConfig(enable_sequence_overlap=True, **sequence).enable_sequence_overlap
    assert ShardConfig(enable_all_optimization=True, **sequence).enable_sequence_overlap, "as ColossalAI does"
    assert not ShardConfig(enable_all_optimization=True).enable_sequence_overlap, "nothing to overlap without SP"
    assert ShardConfig(enable_sequence_overlap=True, use_fp8=True, fp8_communication=True, **sequence)
    assert ShardConfig(enable_all_optimization=True, fp8_communication=True, **sequence).enable_sequence_overlap
    all_to_all: dict[str, Any] = {"enable_sequence_parallelism": True, "sequence_parallelism_mode": "all_to_all"}
    assert not ShardConfig(enable_all_optimization=True, **all_to_all).enable_sequence_overlap


@distributed(world_size=2)
def test_shardformer_overlap_models(rank: int, world_size: int) -> None:
    """GPT-2 (Conv1D layers, fused q/k/v) sharded tp 2 with split_gather, overlapped against plain: loss and every
    gradient within the rounding of a gradient sum (the ring adds q, k and v's input gradients per chunk, autograd
    adds them whole, in another order). The generic policy cannot run the ring and says so."""
    pytest.importorskip("transformers")
    from shardformer_models import build, tokens

    sequence: dict[str, Any] = {"enable_sequence_parallelism": True, "sequence_parallelism_mode": "split_gather"}
    runs = []
    for overlap in (False, True):
        model, _ = ShardFormer(ShardConfig(enable_sequence_overlap=overlap, **sequence)).optimize(build("gpt2"))
        ids = tokens(0)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        rings = sum(bool(getattr(m, "sequence_overlap", False)) for m in model.modules())
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert len(grads) == len(list(model.parameters())), "every parameter has a gradient"
        runs.append((loss.detach(), grads, rings))
    (plain_loss, plain_grads, plain_rings), (loss, grads, rings) = runs
    assert (rings, plain_rings) == (2 * 4, 0), "c_attn, c_proj, c_fc, c_proj of both layers"
    tolerance = sum_tolerance(64 * tokens(0).numel(), 1e-2)  # a gradient element's terms (tiny_model_adam_tolerance)
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=tolerance)
    for name, grad in grads.items():
        error = float((grad - plain_grads[name]).abs().max())
        assert error <= tolerance, f"{name}: overlapped and plain gradients differ by {error:.3g} > {tolerance:.3g}"
    with pytest.raises(ValueError, match="enable_sequence_overlap: TPPlanPolicy cannot verify"):
        ShardFormer(ShardConfig(enable_sequence_overlap=True, **sequence)).optimize(build("qwen2"))
