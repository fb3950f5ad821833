"""GPT-2 Conv1D variants on 2 ranks against transformers' Conv1D: the fused c_attn (q, k, v split separately),
a plain column Conv1D (c_fc) and the row Conv1D (c_proj), with and without the sequence split. Skips without
transformers."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from cx_mesh.testing import distributed
from cx_shardformer import GPT2FusedLinearConv1D_Col, GPT2FusedLinearConv1D_Row
from shardformer_helpers import assert_close, chunk, full_grad

pytest.importorskip("transformers")

B, S, H = 2, 4, 8


def _conv(out_features: int, in_features: int) -> Any:
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(out_features, in_features)
    torch.nn.init.normal_(conv.bias)
    return conv


@distributed(world_size=2)
@pytest.mark.parametrize("n_fused", [3, 1])
@pytest.mark.parametrize("seq_mode", [None, "split_gather"])
def test_shardformer_conv1d_col_matches_plain(rank: int, world_size: int, n_fused: int, seq_mode: str | None) -> None:
    plain = _conv(n_fused * H, H)
    ref = copy.deepcopy(plain)
    weight = plain.weight
    layer = GPT2FusedLinearConv1D_Col.from_native_module(
        plain, None, n_fused=n_fused, gather_output=True, seq_parallel_mode=seq_mode
    )
    assert layer.weight is weight
    assert weight.shape == (H, n_fused * H // world_size)
    torch.manual_seed(1)
    x = torch.randn(B, S, H)
    g = torch.randn(B, S, n_fused * H)
    x_ref = x.clone().requires_grad_()
    expected = ref(x_ref)
    (expected * g).sum().backward()
    x_in = (chunk(x, 1, rank, world_size) if seq_mode else x).clone().requires_grad_()
    out = layer(x_in)
    assert_close(out, expected.detach(), "gathered output in q, k, v order")
    (out * g).sum().backward()
    assert x_in.grad is not None
    assert x_ref.grad is not None
    assert_close(x_in.grad, chunk(x_ref.grad, 1, rank, world_size) if seq_mode else x_ref.grad, "input grad")
    assert ref.weight.grad is not None
    assert ref.bias.grad is not None
    assert_close(full_grad(weight), ref.weight.grad, "weight grad")
    assert_close(full_grad(layer.bias), ref.bias.grad, "bias grad")  # type: ignore[arg-type]
    assert_close(layer.state_dict()["weight"], ref.weight.detach(), "state_dict full-size")
    ref.load_state_dict(layer.state_dict())


@distributed(world_size=2)
@pytest.mark.parametrize("seq_mode", [None, "split_gather"])
def test_shardformer_conv1d_row_matches_plain(rank: int, world_size: int, seq_mode: str | None) -> None:
    plain = _conv(H, 2 * H)
    ref = copy.deepcopy(plain)
    layer = GPT2FusedLinearConv1D_Row.from_native_module(plain, None, seq_parallel_mode=seq_mode)
    assert layer.weight is plain.weight
    assert plain.weight.shape == (2 * H // world_size, H)
    torch.manual_seed(1)
    x = torch.randn(B, S, 2 * H)
    g = torch.randn(B, S, H)
    x_ref = x.clone().requires_grad_()
    expected = ref(x_ref)
    (expected * g).sum().backward()
    x_in = chunk(x, -1, rank, world_size).requires_grad_()
    out = layer(x_in)
    assert_close(out, chunk(expected, 1, rank, world_size).detach() if seq_mode else expected.detach(), "output")
    (out * (chunk(g, 1, rank, world_size) if seq_mode else g)).sum().backward()
    assert x_in.grad is not None
    assert x_ref.grad is not None
    assert_close(x_in.grad, chunk(x_ref.grad, -1, rank, world_size), "input grad")
    assert ref.weight.grad is not None
    assert ref.bias.grad is not None
    assert layer.bias is not None
    assert_close(full_grad(layer.weight), ref.weight.grad, "weight grad")
    assert layer.bias.grad is not None
    assert_close(layer.bias.grad, ref.bias.grad, "bias grad")
    fresh = _conv(H, 2 * H)
    torch.nn.init.normal_(fresh.weight)
    layer.load_state_dict(fresh.state_dict())
    assert_close(layer.state_dict()["weight"], fresh.weight.detach(), "loaded from a plain Conv1D")
