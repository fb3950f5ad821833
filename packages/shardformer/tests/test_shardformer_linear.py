"""Linear1D_Col / Linear1D_Row / FusedLinear1D_Col on 2 ranks against the plain nn.Linear: parameters sharded in
place (same objects, local shapes), full-size state dicts loadable both ways, forward and backward (weights, biases,
inputs) equal, with and without the sequence-parallel split; an optimizer built before sharding keeps working."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_shardformer import FusedLinear1D_Col, Linear1D_Col, Linear1D_Row
from shardformer_helpers import assert_close, chunk, full_grad

B, S, IN, OUT = 2, 4, 8, 12


def _plain() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    plain = nn.Linear(IN, OUT)
    return plain, copy.deepcopy(plain)


def _data(features: int, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(B, S, features), torch.randn(B, S, out_features)


@distributed(world_size=2)
@pytest.mark.parametrize("gather_output", [True, False])
@pytest.mark.parametrize("seq_mode", [None, "split_gather"])
def test_shardformer_linear_col_matches_plain(
    rank: int, world_size: int, gather_output: bool, seq_mode: str | None
) -> None:
    plain, ref = _plain()
    weight, bias = plain.weight, plain.bias
    layer = Linear1D_Col.from_native_module(plain, None, gather_output=gather_output, seq_parallel_mode=seq_mode)
    assert layer.weight is weight
    assert layer.bias is bias
    assert weight.shape == (OUT // world_size, IN)
    assert bias.shape == (OUT // world_size,)

    x, g = _data(IN, OUT)
    x_ref = x.clone().requires_grad_()
    (ref(x_ref) * g).sum().backward()

    x_in = (chunk(x, 1, rank, world_size) if seq_mode else x).clone().requires_grad_()
    out = layer(x_in)
    g_out = g if gather_output else chunk(g, -1, rank, world_size)
    expected = ref(x) if gather_output else chunk(ref(x), -1, rank, world_size)
    assert_close(out, expected.detach(), "output")
    (out * g_out).sum().backward()
    # gather_output: every rank holds the same loss; otherwise each holds its slice's share of the total loss, and
    # the input gradient is summed over the ranks either way
    grad_in = x_ref.grad
    assert grad_in is not None
    assert x_in.grad is not None
    assert_close(x_in.grad, chunk(grad_in, 1, rank, world_size) if seq_mode else grad_in, "input grad")
    assert ref.weight.grad is not None
    assert ref.bias is not None
    assert ref.bias.grad is not None
    assert_close(full_grad(weight), ref.weight.grad, "weight grad")
    assert_close(full_grad(bias), ref.bias.grad, "bias grad")


@distributed(world_size=2)
@pytest.mark.parametrize("parallel_input", [True, False])
@pytest.mark.parametrize("seq_mode", [None, "split_gather"])
def test_shardformer_linear_row_matches_plain(
    rank: int, world_size: int, parallel_input: bool, seq_mode: str | None
) -> None:
    plain, ref = _plain()
    weight, bias = plain.weight, plain.bias
    layer = Linear1D_Row.from_native_module(plain, None, parallel_input=parallel_input, seq_parallel_mode=seq_mode)
    assert layer.weight is weight
    assert layer.bias is bias
    assert weight.shape == (OUT, IN // world_size)
    assert bias.shape == (OUT,)

    x, g = _data(IN, OUT)
    x_ref = x.clone().requires_grad_()
    (ref(x_ref) * g).sum().backward()

    x_in = (chunk(x, -1, rank, world_size) if parallel_input else x).clone().requires_grad_()
    out = layer(x_in)
    expected = chunk(ref(x), 1, rank, world_size) if seq_mode else ref(x)
    assert_close(out, expected.detach(), "output")
    (out * (chunk(g, 1, rank, world_size) if seq_mode else g)).sum().backward()
    assert x_ref.grad is not None
    assert x_in.grad is not None
    assert_close(x_in.grad, chunk(x_ref.grad, -1, rank, world_size) if parallel_input else x_ref.grad, "input grad")
    assert ref.weight.grad is not None
    assert ref.bias is not None
    assert ref.bias.grad is not None
    assert_close(full_grad(weight), ref.weight.grad, "weight grad")
    assert bias.grad is not None
    assert_close(bias.grad, ref.bias.grad, "bias grad (replicated, full on every rank)")


@distributed(world_size=2)
@pytest.mark.parametrize("gather_output", [True, False])
def test_shardformer_fused_col_splits_each_part(rank: int, world_size: int, gather_output: bool) -> None:
    """q (8), k (2), v (2) fused: each rank holds its heads of every part; gathered output in q, k, v order."""
    parts = [8, 2, 2]
    torch.manual_seed(0)
    plain = nn.Linear(IN, sum(parts))
    ref = copy.deepcopy(plain)
    layer = FusedLinear1D_Col.from_native_module(plain, None, split_sizes=parts, gather_output=gather_output)
    local = [p // world_size for p in parts]
    expected_rows = torch.cat([w.chunk(world_size, 0)[rank] for w in ref.weight.detach().split(parts, 0)])
    assert_close(layer.weight.detach(), expected_rows, "local rows are this rank's slice of q, k and v")

    x, _ = _data(IN, sum(parts))
    x_ref = x.clone().requires_grad_()
    x_in = x.clone().requires_grad_()
    full_ref = ref(x_ref)
    out = layer(x_in)
    if gather_output:
        assert_close(out, full_ref.detach(), "gathered output")
        weights = torch.arange(out.numel(), dtype=out.dtype).view_as(out) / out.numel()
        (out * weights).sum().backward()
        (full_ref * weights).sum().backward()
    else:
        ref_pieces = [p.chunk(world_size, -1)[rank] for p in full_ref.split(parts, -1)]
        assert_close(out, torch.cat(ref_pieces, -1).detach(), "local output")
        assert [p.shape[-1] for p in out.split(local, -1)] == local
        out.square().sum().backward()
        full_ref.square().sum().backward()
    assert x_ref.grad is not None
    assert x_in.grad is not None
    assert ref.weight.grad is not None
    assert_close(x_in.grad, x_ref.grad, "input grad")
    assert_close(full_grad(layer.weight), ref.weight.grad, "weight grad")
    state = layer.state_dict()
    assert_close(state["weight"], ref.weight.detach(), "state_dict is full-size in the original order")


@distributed(world_size=2)
@pytest.mark.parametrize("kind", ["col", "row", "fused"])
def test_shardformer_linear_state_dict_round_trip(rank: int, world_size: int, kind: str) -> None:
    plain, ref = _plain()
    if kind == "col":
        layer: nn.Module = Linear1D_Col.from_native_module(plain)
    elif kind == "row":
        layer = Linear1D_Row.from_native_module(plain)
    else:
        layer = FusedLinear1D_Col.from_native_module(plain, split_sizes=[4, 8])
    state = layer.state_dict()
    assert set(state) == {"weight", "bias"}
    for name, value in ref.state_dict().items():
        assert_close(state[name], value, f"state_dict[{name}] is the full tensor")
    other = nn.Linear(IN, OUT)
    other.load_state_dict(state)  # the plain module loads the sharded layer's state dict
    torch.manual_seed(5)
    fresh = nn.Linear(IN, OUT)
    layer.load_state_dict(fresh.state_dict())  # and the sharded layer loads a plain one
    for name, value in fresh.state_dict().items():
        assert_close(layer.state_dict()[name], value, f"{name} after loading a plain state dict")
    bad = {"weight": torch.zeros(OUT // 2, IN), "bias": torch.zeros(OUT)}
    with pytest.raises(RuntimeError, match="loads full-size tensors"):
        layer.load_state_dict(bad)


@distributed(world_size=2)
def test_shardformer_optimizer_built_before_sharding_keeps_working(rank: int, world_size: int) -> None:
    plain, ref = _plain()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.1)
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=0.1)
    layer = Linear1D_Col.from_native_module(plain, gather_output=True)
    x, g = _data(IN, OUT)
    for _ in range(3):
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        (layer(x) * g).sum().backward()
        (ref(x) * g).sum().backward()
        optimizer.step()
        ref_optimizer.step()
    assert_close(layer.state_dict()["weight"], ref.weight.detach(), "weight after 3 AdamW steps")


@distributed(world_size=2)
def test_shardformer_linear_errors(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="not divisible by 2"):
        Linear1D_Col.from_native_module(nn.Linear(4, 5))
    with pytest.raises(ValueError, match="sequence parallelism inside attention"):
        Linear1D_Col.from_native_module(nn.Linear(4, 4), seq_parallel_mode="all_to_all")
    with pytest.raises(ValueError, match="unknown seq_parallel_mode"):
        Linear1D_Row.from_native_module(nn.Linear(4, 4), seq_parallel_mode="bogus")
    with pytest.raises(TypeError, match=r"expects an nn\.Linear"):
        Linear1D_Row.from_native_module(nn.Conv2d(1, 1, 1))
    with pytest.raises(ValueError, match="split_sizes"):
        FusedLinear1D_Col.from_native_module(nn.Linear(4, 8), split_sizes=[4, 2])
    row = Linear1D_Row.from_native_module(nn.Linear(4, 4), seq_parallel_mode="split_gather")
    with pytest.raises(ValueError, match="has size 3, which is not divisible by the group size 2"):
        row(torch.randn(1, 3, 2))  # a sequence of 3 cannot be reduce-scattered over 2 ranks
