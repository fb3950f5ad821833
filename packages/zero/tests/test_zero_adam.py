"""HybridAdam / CPUAdam against torch.optim.AdamW and Adam (fp32 rounding tolerance), state interchange, errors."""

from __future__ import annotations

import copy

import pytest
import torch

from cx_zero import CPUAdam, HybridAdam


def _params(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g).to(dtype).requires_grad_(True) for shape in ((31, 7), (5,), (1000,))]


def _run(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], steps: int = 5) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        optimizer.step()


@pytest.mark.parametrize("cls", [HybridAdam, CPUAdam])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_zero_hybrid_adam_matches_torch(cls: type[CPUAdam], adamw_mode: bool) -> None:
    ours, theirs = _params(), _params()
    kwargs = {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05}
    reference_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    _run(cls(ours, adamw_mode=adamw_mode, **kwargs), ours)  # type: ignore[arg-type]
    _run(reference_cls(theirs, **kwargs), theirs)  # type: ignore[arg-type]
    for p, q in zip(ours, theirs, strict=True):
        # A fused kernel orders the same float ops differently: a few fp32 ulp after 5 steps.
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_zero_hybrid_adam_without_bias_correction() -> None:
    params = _params()
    expected = [p.detach().clone() for p in params]
    optimizer = HybridAdam(params, lr=1e-2, bias_correction=False, weight_decay=0.1)
    _run(optimizer, params, steps=3)
    g = torch.Generator().manual_seed(1)
    m = [torch.zeros_like(e) for e in expected]
    v = [torch.zeros_like(e) for e in expected]
    for _ in range(3):
        for i, e in enumerate(expected):
            grad = torch.randn(e.shape, generator=g)
            e.mul_(1 - 1e-2 * 0.1)
            m[i] = 0.9 * m[i] + 0.1 * grad
            v[i] = 0.999 * v[i] + 0.001 * grad * grad
            e.sub_(1e-2 * m[i] / (v[i].sqrt() + 1e-8))
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)


def test_zero_hybrid_adam_bf16_params_and_state_interchange() -> None:
    params = _params(torch.bfloat16)
    optimizer = HybridAdam(params, lr=1e-2)
    _run(optimizer, params, steps=2)
    assert all(optimizer.state[p]["exp_avg"].dtype == torch.bfloat16 for p in params)
    # The state dict loads into torch's AdamW (same state names) and continues like ours does.
    fp32 = _params()
    ours = HybridAdam(fp32, lr=1e-2)
    _run(ours, fp32, steps=2)
    copies = [p.detach().clone().requires_grad_(True) for p in fp32]
    theirs = torch.optim.AdamW(copies, lr=1e-2)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))  # torch aliases loaded tensors
    _run(ours, fp32, steps=2)
    _run(theirs, copies, steps=2)
    for p, q in zip(fp32, copies, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_zero_hybrid_adam_rejects_unsupported_options() -> None:
    with pytest.raises(NotImplementedError, match="NVMe offload"):
        HybridAdam(_params(), nvme_offload_fraction=0.5)
    with pytest.raises(TypeError, match="unsupported arguments"):
        HybridAdam(_params(), amsgrad=True)
    with pytest.raises(ValueError, match="betas"):
        CPUAdam(_params(), betas=(1.0, 0.9))
