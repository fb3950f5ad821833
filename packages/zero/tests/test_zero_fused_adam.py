"""FusedAdam (ColossalAI's argument order) against torch.optim.AdamW / Adam, its zero_grad and its clear errors."""

from __future__ import annotations

import pytest
import torch

from cx_zero import FusedAdam


def _params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g).requires_grad_(True) for shape in ((17, 3), (9,))]


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_fused_adam_matches_torch_with_colossalai_positional_order(adamw_mode: bool) -> None:
    ours, theirs = _params(), _params()
    # ColossalAI's order: params, lr, bias_correction, betas, eps, adamw_mode, weight_decay
    optimizer = FusedAdam(ours, 1e-2, True, (0.8, 0.99), 1e-6, adamw_mode, 0.05)
    reference_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    reference = reference_cls(theirs, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        for p, q in zip(ours, theirs, strict=True):
            q.grad = torch.randn(q.shape, generator=g)
            p.grad = q.grad.clone()
        optimizer.step()
        reference.step()
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_fused_adam_zero_grad_follows_set_grad_none() -> None:
    params = _params()
    for set_grad_none, expected_none in ((True, True), (False, False)):
        optimizer = FusedAdam(params, set_grad_none=set_grad_none)
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.zero_grad()
        assert all((p.grad is None) == expected_none for p in params)


def test_fused_adam_amsgrad_is_a_clear_error() -> None:
    with pytest.raises(NotImplementedError, match="amsgrad"):
        FusedAdam(_params(), amsgrad=True)
