"""Grouped experts: the grouped matmul and the loop agree with a per-token reimplementation, in value and
gradient, including experts that get no rows; unsupported dtypes fall back to the loop."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from cx_moe import ExpertImplementation, GroupedExperts, grouped_linear, grouped_mm_supported


def _per_token(x: torch.Tensor, experts: torch.Tensor, module: GroupedExperts) -> torch.Tensor:
    """Each row through its own expert, written out (transformers' eager formula)."""
    rows = []
    for row, e in zip(x, experts.tolist(), strict=True):
        gate, up = F.linear(row, module.gate_up_proj[e]).chunk(2)
        rows.append(F.linear(F.silu(gate) * up, module.down_proj[e]))
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])


@pytest.mark.parametrize("implementation", [ExpertImplementation.GROUPED_MM, ExpertImplementation.LOOP])
@pytest.mark.parametrize("counts", [[3, 0, 4, 1], [0, 0, 0, 0], [0, 5, 0, 0]])
def test_grouped_experts_match_per_token_formula(implementation: ExpertImplementation, counts: list[int]) -> None:
    torch.manual_seed(0)
    module = GroupedExperts(4, 16, 8, implementation=implementation)
    x = torch.randn(sum(counts), 16, requires_grad=True)
    experts = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    out = module(x, counts)
    expected = _per_token(x, experts, module)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.sum().backward()  # an expanded (stride 0) gradient: the grouped matmul needs it made contiguous
    got = [x.grad, module.gate_up_proj.grad, module.down_proj.grad]
    for p in (x, module.gate_up_proj, module.down_proj):
        p.grad = None
    if expected.requires_grad:
        expected.sum().backward()
        want = [x.grad, module.gate_up_proj.grad, module.down_proj.grad]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for e, count in enumerate(counts):  # an expert with no rows gets a zero gradient, not none
        assert got[1] is not None
        if count == 0:
            assert not got[1][e].any()


def test_grouped_mm_support_rules() -> None:
    assert grouped_mm_supported(torch.randn(4, 16), torch.randn(2, 8, 16))
    with FakeTensorMode():  # cx-plan's trace: no address, the storage offset decides (and no data_ptr warning)
        base = torch.randn(65, 16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert grouped_mm_supported(base[1:], torch.randn(2, 8, 16))  # 64 bytes in
            assert not grouped_mm_supported(base.view(-1)[1:1025].view(64, 16), torch.randn(2, 8, 16))  # 4 bytes in
    assert not grouped_mm_supported(torch.randn(4, 16, dtype=torch.float64), torch.randn(2, 8, 16, dtype=torch.float64))
    assert not grouped_mm_supported(torch.randn(4, 6), torch.randn(2, 8, 6))  # 24-byte rows: not 16-byte aligned
    x, w = torch.randn(5, 6, dtype=torch.float64), torch.randn(2, 3, 6, dtype=torch.float64)
    out = grouped_linear(x, w, [2, 3])  # auto falls back to the loop
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0].T, x[2:] @ w[1].T]))


def test_plain_experts_and_bad_counts() -> None:
    torch.manual_seed(0)
    module = GroupedExperts(2, 16, 8, gated=False)
    assert module.up_proj.shape == (2, 8, 16)
    x = torch.randn(3, 16)
    torch.testing.assert_close(module(x, [1, 2])[0], module.down_proj[0] @ F.silu(module.up_proj[0] @ x[0]))
    with pytest.raises(ValueError, match=r"counts .1, 1. must have one entry per expert .2. summing to the rows .3."):
        module(x, [1, 1])
