"""Shared helpers for cx-shardformer tests: full-size views of sharded tensors and closeness checks."""

from __future__ import annotations

import torch
from torch import nn

from cx_shardformer import get_shard_spec, unshard_tensor

RTOL, ATOL = 1e-5, 1e-6


def full_grad(param: nn.Parameter, group: object = None) -> torch.Tensor:
    """The full-size gradient of a (possibly sharded) parameter."""
    assert param.grad is not None, "parameter has no gradient"
    spec = get_shard_spec(param)
    return param.grad if spec is None else unshard_tensor(param.grad, spec, group)  # type: ignore[arg-type]


def full_value(param: nn.Parameter, group: object = None) -> torch.Tensor:
    spec = get_shard_spec(param)
    return param.detach() if spec is None else unshard_tensor(param, spec, group)  # type: ignore[arg-type]


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL, atol: float = ATOL
) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def chunk(tensor: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return tensor.chunk(world, dim)[rank].contiguous()


class GPT2Conv1D(nn.Module):
    """transformers' Conv1D ([in, out] weight, y = x @ W + b), without importing transformers."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * nx**-0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)
