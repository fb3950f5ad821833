"""fp8_test_helpers.assert_first_step_within_adam, on one AdamW step of a few elements: gradients of opposite signs
(the bound's worst case, 2 * lr apart, weight decay cancelling) pass, bf16 storage's rounding included; a difference
past 2 * lr and that rounding fails; mismatched names or shapes are refused by name."""

from __future__ import annotations

import pytest
import torch

from fp8_test_helpers import assert_first_step_within_adam

LR, WEIGHT_DECAY = 3e-3, 0.01


def _one_step(start: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One torch.optim.AdamW step from `start` with gradient `grad`, the result stored in `dtype`."""
    param = torch.nn.Parameter(start.clone())
    param.grad = grad.clone()
    torch.optim.AdamW([param], lr=LR, weight_decay=WEIGHT_DECAY).step()
    return param.detach().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opposite_gradients_stay_within_and_a_larger_gap_fails(dtype: torch.dtype) -> None:
    start = torch.tensor([0.02, -0.5, 1.0, 3.0])
    grad = torch.tensor([1e-3, -2.0, 0.5, 1e-6])
    initial = {"w": start.to(dtype)}
    bf16, fp8 = {"w": _one_step(start, grad, dtype)}, {"w": _one_step(start, -grad, dtype)}
    assert assert_first_step_within_adam(initial, bf16, fp8, LR) < 1  # every element moved the other way
    assert assert_first_step_within_adam(initial, bf16, bf16, LR) == 1
    # 3 * lr apart at 0.02: past 2 * lr plus the bound's rounding allowance (4 * 2**-8 * (0.02 + 0.03 + 2 * lr))
    past = {"w": (bf16["w"].float() + torch.tensor([3 * LR, 0, 0, 0])).to(dtype)}
    with pytest.raises(AssertionError, match="w: fp8 and bf16 differ by"):
        assert_first_step_within_adam(initial, bf16, past, LR)


def test_mismatched_parameters_are_refused() -> None:
    one, two = {"w": torch.zeros(2)}, {"w": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"parameter names differ: \['v', 'w'\]"):
        assert_first_step_within_adam(one, one, {"v": torch.zeros(2)}, LR)
    with pytest.raises(ValueError, match="w: shapes differ"):
        assert_first_step_within_adam(one, one, two, LR)
