"""Gradient norm, clipping and overflow over process groups, against torch's single-process functions."""

from __future__ import annotations

import math

import pytest
import torch

from cx_mesh.testing import distributed
from cx_zero import NormType, any_across_groups, clip_grad_norm_, compute_grad_norm, has_inf_or_nan
from zero_test_helpers import mesh_2x2


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * (i + 1) for i, n in enumerate((5, 17, 3, 64, 9, 2, 31, 8))]


@pytest.mark.parametrize("norm_type", [2.0, "inf", float("inf")])
def test_zero_local_norm_matches_torch(norm_type: float | str) -> None:
    tensors = _tensors()
    expected = torch.nn.utils.get_total_norm(tensors, float(norm_type))
    torch.testing.assert_close(compute_grad_norm(tensors, norm_type), expected, rtol=1e-6, atol=0)


def test_zero_norm_type_parsing() -> None:
    assert NormType.parse(2) is NormType.TWO
    assert NormType.parse("INF") is NormType.INF
    with pytest.raises(ValueError, match="expected 2 or inf"):
        NormType.parse(1)
    with pytest.raises(ValueError, match="expected 2 or inf"):
        NormType.parse("fro")


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("norm_type", [2.0, "inf"])
def test_zero_distributed_clip_equals_torch_on_unsharded(rank: int, world_size: int, norm_type: float | str) -> None:
    full = [torch.nn.Parameter(t.clone()) for t in _tensors(1)]
    ours = [torch.nn.Parameter(t.clone()) for t in _tensors(1)]
    for p, q, t in zip(full, ours, _tensors(1), strict=True):
        p.grad, q.grad = t.clone(), t.clone()
    mine = [p for i, p in enumerate(ours) if i % world_size == rank]  # each rank holds a disjoint part
    expected = torch.nn.utils.clip_grad_norm_(full, 1.5, norm_type=float(norm_type))
    total = clip_grad_norm_(mine, 1.5, norm_type, groups=[None])
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for i, (p, q) in enumerate(zip(full, ours, strict=True)):
        if i % world_size == rank:
            assert p.grad is not None
            assert q.grad is not None
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=0)
            assert not torch.equal(q.grad, _tensors(1)[i]), "the gradients must have been clipped"


@distributed(world_size=4)
def test_zero_norm_reduces_over_exactly_the_given_groups(rank: int, world_size: int) -> None:
    """Over the "b" axis only: ranks {0,1} and {2,3} each see their own pair's norm, not the world's."""
    group = mesh_2x2().get_group_along_axis("b")
    value = torch.tensor([float(rank + 1)])
    norm = compute_grad_norm([value], 2.0, groups=[group])
    pair = (1, 2) if rank < 2 else (3, 4)
    assert float(norm) == pytest.approx(math.sqrt(sum(v * v for v in pair)))
    both = compute_grad_norm([value], 2.0, groups=[group, mesh_2x2().get_group_along_axis("a")])
    assert float(both) == pytest.approx(math.sqrt(1 + 4 + 9 + 16))


@distributed(world_size=4)
def test_zero_overflow_flag_over_groups(rank: int, world_size: int) -> None:
    group = mesh_2x2().get_group_along_axis("b")
    bad = torch.tensor([1.0, float("nan")]) if rank == 3 else torch.ones(2)
    local = has_inf_or_nan([torch.ones(3), bad])
    assert local == (rank == 3)
    assert any_across_groups(local, [group]) == (rank >= 2)
    assert any_across_groups(local, [group, mesh_2x2().get_group_along_axis("a")])
    assert not has_inf_or_nan([])


def test_zero_norm_of_nothing_is_zero() -> None:
    assert float(compute_grad_norm([])) == 0.0
    assert float(compute_grad_norm([torch.zeros(0)], "inf")) == 0.0


@distributed(world_size=2)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("norm_type", [2.0, "inf"])
def test_zero_norm_or_inf_sees_one_ranks_inf(rank: int, world_size: int, bad: float, norm_type: float | str) -> None:
    """The fp16 overflow flag of ZeRO and Gemini: an inf or nan on one rank only makes the norm inf on every rank
    (a +inf was once turned into the largest finite float before the reduction, and the overflow went unseen)."""
    from cx_zero._norm import norm_or_inf

    grads = [torch.tensor([bad, 1.0]) if rank == 0 else torch.ones(2)]
    assert norm_or_inf(grads, norm_type, [None]) == math.inf


def test_zero_local_norm_term_weights() -> None:
    """Weights multiply each tensor's sum of squares (a tensor replicated over k ranks counts 1/k per rank) and leave
    the inf-norm alone; one weight per tensor is required."""
    from cx_zero import local_norm_term

    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([1.0]), torch.zeros(0)]
    assert float(local_norm_term(tensors, 2.0, [0.5, 2.0, 7.0])) == pytest.approx(25 * 0.5 + 1 * 2.0)
    assert float(local_norm_term(tensors, "inf", [0.5, 2.0, 7.0])) == 4.0
    with pytest.raises(ValueError, match="2 weights for 3 tensors"):
        local_norm_term(tensors, 2.0, [1.0, 1.0])
