"""Capacity-limited routing: which assignments are dropped follows the documented policy, and the layer's output
equals the dropless computation with the dropped assignments' weights set to zero (padded or not)."""

from __future__ import annotations

import pytest
import torch

from cx_moe import (
    CapacityOptions,
    DropPolicy,
    ExpertOptions,
    MoeLayer,
    RouterOptions,
    expert_capacity,
    rank_within_expert,
)


def _reference_ranks(weights: torch.Tensor, indices: torch.Tensor, policy: DropPolicy) -> torch.Tensor:
    """Written out: per expert, its assignments sorted by (-weight, position) or by position alone."""
    tokens, k = indices.shape
    ranks = torch.empty_like(indices)
    for e in indices.unique().tolist():
        members = [(t, s) for t in range(tokens) for s in range(k) if indices[t, s] == e]
        if policy is DropPolicy.PROBABILITY:
            members.sort(key=lambda ts: (-float(weights[ts]), ts[0] * k + ts[1]))
        for rank, ts in enumerate(members):
            ranks[ts] = rank
    return ranks


@pytest.mark.parametrize("policy", list(DropPolicy))
def test_rank_within_expert_follows_the_policy(policy: DropPolicy) -> None:
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(12, 2, generator=g)
    indices = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(12)])
    torch.testing.assert_close(
        rank_within_expert(weights, indices, 4, policy), _reference_ranks(weights, indices, policy)
    )


def test_position_policy_keeps_the_earliest_tokens() -> None:
    indices = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    weights = torch.tensor([[0.1, 0.9], [0.2, 0.8], [0.9, 0.1], [0.5, 0.5]])
    keep = rank_within_expert(weights, indices, 4, DropPolicy.POSITION) < 2
    # expert 0 is chosen by tokens 0, 1, 2, 3: with capacity 2 only tokens 0 and 1 keep it
    assert keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    keep = rank_within_expert(weights, indices, 4, DropPolicy.PROBABILITY) < 2
    # by probability expert 0 keeps token 2 (0.9) and token 3 (0.5)
    assert keep.tolist() == [[False, True], [False, True], [True, True], [True, True]]


def test_capacity_formula() -> None:
    assert expert_capacity(CapacityOptions(1.0), 10, 2, 4) == 5
    assert expert_capacity(CapacityOptions(1.25), 10, 2, 4) == 7
    assert expert_capacity(CapacityOptions(0.01, min_capacity=3), 10, 2, 4) == 3


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("policy", ["probability", "position"])
def test_capacity_layer_equals_dropless_with_dropped_weights_zeroed(pad: bool, policy: str) -> None:
    experts, router = ExpertOptions(16, 8), RouterOptions(4, 2)
    capacity = CapacityOptions(0.5, drop_policy=policy, pad_to_capacity=pad)
    torch.manual_seed(0)
    layer = MoeLayer(experts, router, capacity=capacity)
    torch.manual_seed(0)
    dropless = MoeLayer(experts, router)
    x = torch.randn(10, 16)
    out = layer(x)
    routing = dropless.gate(x)
    ranks = rank_within_expert(routing.weights, routing.indices, 4, DropPolicy(policy))
    keep = ranks < expert_capacity(capacity, 10, 2, 4)
    assert not keep.all(), "the test must drop some assignments"
    assert keep.any(), "the test must keep some assignments"
    expected = dropless.route_to_experts(x, routing.indices, routing.weights * keep)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    assert layer.experts.gate_up_proj.grad is not None


def test_capacity_options_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        CapacityOptions(0.0)
    with pytest.raises(ValueError, match=r"drop_policy must be one of \['probability', 'position'\]"):
        CapacityOptions(1.0, drop_policy="random")
