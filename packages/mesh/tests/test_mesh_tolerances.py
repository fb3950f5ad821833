"""The tolerances of cx_mesh.testing hold for the arithmetic they claim to bound: reordered fp32 sums stay within
`sum_tolerance`, and one Adam step with perturbed gradients stays within `adam_step_tolerance`, while at the
default eps a near-zero gradient's rounding flips an lr-sized step (the reason tests use TEST_ADAM_EPS)."""

from __future__ import annotations

import pytest
import torch

from cx_mesh.testing import TEST_ADAM_EPS, adam_step_tolerance, sum_tolerance, unit_roundoff


def test_mesh_tolerances_unit_roundoff() -> None:
    assert unit_roundoff(torch.float32) == 2.0**-24
    assert unit_roundoff(torch.bfloat16) == 2.0**-8


@pytest.mark.parametrize("n_terms", [16, 1024, 65536])
def test_mesh_tolerances_sum_bounds_every_ordering(n_terms: int) -> None:
    generator = torch.Generator().manual_seed(n_terms)
    for _ in range(20):
        terms = torch.randn(n_terms, generator=generator, dtype=torch.float64)
        exact = float(terms.sum())
        bound = sum_tolerance(n_terms, float(terms.abs().sum()))
        single = terms.float()
        orders = [single, single.flip(0), single[torch.randperm(n_terms, generator=generator)]]
        for ordered in orders:
            sequential = torch.zeros((), dtype=torch.float32)
            for chunk in ordered.split(max(1, n_terms // 8)):  # partial sums, as tensor parallelism makes them
                sequential = sequential + chunk.sum()
            assert abs(float(sequential) - exact) <= bound
            assert abs(float(ordered.sum()) - exact) <= bound


def _adam_step(grad: torch.Tensor, eps: float, lr: float = 1e-2) -> torch.Tensor:
    param = torch.nn.Parameter(torch.zeros_like(grad))
    optimizer = torch.optim.AdamW([param], lr=lr, eps=eps, weight_decay=0.0)
    param.grad = grad.clone()
    optimizer.step()
    return param.detach().clone()


def test_mesh_tolerances_adam_step_is_bounded_at_test_eps() -> None:
    generator = torch.Generator().manual_seed(0)
    grads = torch.cat([torch.randn(1000, generator=generator) * 1e-2, torch.randn(1000, generator=generator) * 1e-8])
    noise = 1e-7
    perturbed = grads + noise * torch.randn(grads.shape, generator=generator).sign()
    difference = (_adam_step(grads, TEST_ADAM_EPS) - _adam_step(perturbed, TEST_ADAM_EPS)).abs().max()
    assert float(difference) <= adam_step_tolerance(1e-2, TEST_ADAM_EPS, noise)
    # at torch's default eps the near-zero gradients' steps are decided by the noise: about lr apart
    at_default = (_adam_step(grads, 1e-8) - _adam_step(perturbed, 1e-8)).abs().max()
    assert float(at_default) > 0.5e-2


def test_mesh_tolerances_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="n_terms"):
        sum_tolerance(0, 1.0)
    with pytest.raises(ValueError, match="eps > 0"):
        adam_step_tolerance(1e-2, 0.0, 1e-7)
    assert adam_step_tolerance(1e-2, 1e-12, 1.0) == 2e-2  # never more than two opposite lr-sized steps
