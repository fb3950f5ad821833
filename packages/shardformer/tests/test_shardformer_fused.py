"""enable_jit_fused: the compiled kernels (`_fused`) against the unfused transformers ops, forward and backward,
dropout with the same mask; the policy rules (what is fused, nothing to fuse, enable_all_optimization). The
model-level runs (tp 2, HybridParallelPlugin, GeminiPlugin and MoeHybridParallelPlugin) are in cx-plugins and use
aot_eager; here inductor, the real backend, builds every kernel once, at one shared small shape ([2, 8, 32]). Cost,
cold inductor cache, 2 cores at load 13: 83 s for the first kernel (inductor's one-time start-up), 17 s for the
other four together.

Tolerances from the arithmetic (u = 2**-24, fp32's unit roundoff):
- Element-wise kernels (bias + GELU, bias + dropout, act(gate) * up): both sides evaluate the same chain of at most
  12 fp32 operations (GELU's tanh form, backward, is the longest), each rounding once to within u of its result,
  and the transcendental functions (inductor's vectorised tanh / exp / sigmoid against ATen's) are within 1 ulp
  (2u) of exact: 2 * 12u + 2 * 2 * 2u = 32u of max(1, |result|) on these O(1) inputs (`ELEMENTWISE`, used as rtol and
  atol). Dropout masks must be identical: an element is zero in both or in neither.
- RMSNorm: as above, plus the reductions, which inductor may add in another order: the mean of the 32 squares
  (positive terms, so `sum_tolerance(32, 1)` relative; halved by rsqrt, tripled in the backward's r**3), the
  backward's sum of the 32 terms w g x (absolute, `sum_tolerance(32, sum |w g x|)`), and the weight's gradient summed
  over the 16 tokens (`sum_tolerance(16, sum |g x r|)`). `_rms_norm_bounds` computes them per element.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from cx_mesh.testing import sum_tolerance, unit_roundoff
from cx_shardformer import ShardConfig
from cx_shardformer._fused import bias_act, bias_dropout, compile_backend, rms_norm, swiglu
from cx_shardformer.policies._fused import apply_jit_fused

transformers = pytest.importorskip("transformers")

ELEMENTWISE = 32 * unit_roundoff(torch.float32)  # 2**-19 (module docs)
SHAPE, HIDDEN = (2, 8, 32), 32  # 16 tokens of 32 features, shared by every kernel


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def _named(what: str) -> Callable[[str], str]:
    return lambda message: f"{what}: {message}"


def _check(fused: torch.Tensor, plain: torch.Tensor, inputs: list[torch.Tensor], what: str) -> None:
    torch.testing.assert_close(fused, plain, rtol=ELEMENTWISE, atol=ELEMENTWISE, msg=_named(f"{what} forward"))
    grad = torch.randn_like(plain)
    fused_grads = torch.autograd.grad(fused, inputs, grad)
    plain_grads = torch.autograd.grad(plain, inputs, grad)
    for i, (a, b) in enumerate(zip(fused_grads, plain_grads, strict=True)):
        torch.testing.assert_close(a, b, rtol=ELEMENTWISE, atol=ELEMENTWISE, msg=_named(f"{what} grad {i}"))


def _within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    excess = (actual.double() - expected.double()).abs() - bound
    assert excess.max() <= 0, f"{what}: off by {excess.max().item():.3g} beyond the derived bound"


def _rms_norm_bounds(
    x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element bounds on |fused - unfused| for RMSNorm's output, grad x and grad weight (module docs), in float64:
    out = w x r with r = rsqrt(mean(x^2) + eps); grad_x = w g r - x r^3 mean(w g x); grad_w = sum_tokens g x r."""
    x, w, g = x.detach().double(), weight.detach().double(), grad.double()
    n = x.shape[-1]
    mean_rel = sum_tolerance(n, 1.0)  # relative: the squares are positive
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    out = (w * x * r).abs()
    wgx = (w * g * x).abs().sum(-1, keepdim=True)
    direct, through_mean = (w * g).abs() * r, x.abs() * r**3 * wgx / n
    grad_x = (ELEMENTWISE + 3 * mean_rel / 2) * (direct + through_mean)
    grad_x += x.abs() * r**3 / n * sum_tolerance(n, 1.0) * wgx  # the sum of the n terms w g x
    gxr = (g * x * r).abs().reshape(-1, n).sum(0)
    tokens = x.numel() // n
    grad_w = (ELEMENTWISE + mean_rel / 2) * gxr + sum_tolerance(tokens, 1.0) * gxr
    return (ELEMENTWISE + mean_rel / 2) * out, grad_x, grad_w


@pytest.mark.slow
def test_shardformer_fused_kernels_match_unfused_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel built by inductor (the first compile of each is what this test's time is)."""
    from transformers.activations import NewGELUActivation
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    monkeypatch.delenv("CX_JIT_FUSED_BACKEND", raising=False)
    assert compile_backend() == "inductor"
    torch.manual_seed(0)
    x, y, bias = _leaf(*SHAPE), _leaf(*SHAPE), _leaf(HIDDEN)
    gelu = NewGELUActivation()
    _check(bias_act(x, bias, gelu), gelu(x + bias), [x, bias], "bias + GELU")

    dropout = nn.Dropout(0.25).train()
    torch.manual_seed(7)
    fused = bias_dropout(x, bias, dropout)
    torch.manual_seed(7)
    plain = dropout(x + bias)
    assert torch.equal(fused == 0, plain == 0), "the same elements dropped"
    _check(fused, plain, [x, bias], "bias + dropout")
    _check(bias_dropout(x, bias, dropout.eval()), x + bias, [x, bias], "bias + dropout (eval)")

    silu = nn.SiLU()
    _check(swiglu(x, y, silu), silu(x) * y, [x, y], "act(gate) * up")

    norm = LlamaRMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(HIDDEN) + 0.5)
    fused, plain = rms_norm(x, norm.weight, 1e-6), norm(x)
    grad = torch.randn_like(plain)
    out_bound, x_bound, w_bound = _rms_norm_bounds(x, norm.weight, grad, 1e-6)
    _within(fused, plain, out_bound, "RMSNorm forward")
    fused_grads = torch.autograd.grad(fused, [x, norm.weight], grad)
    plain_grads = torch.autograd.grad(plain, [x, norm.weight], grad)
    _within(fused_grads[0], plain_grads[0], x_bound, "RMSNorm grad x")
    _within(fused_grads[1], plain_grads[1], w_bound, "RMSNorm grad weight")


def test_shardformer_jit_fused_policy_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CX_JIT_FUSED_BACKEND", "aot_eager")
    assert ShardConfig(enable_all_optimization=True).enable_jit_fused, "as ColossalAI does"
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    )
    fused = apply_jit_fused(llama, ShardConfig(enable_jit_fused=True, enable_tensor_parallelism=False))
    names = ["model.layers.0.input_layernorm", "model.layers.0.mlp", "model.layers.0.post_attention_layernorm"]
    assert sorted(fused) == [*names, "model.norm"]
    ids = torch.randint(0, 32, (2, 8))
    assert torch.isfinite(llama(input_ids=ids, labels=ids).loss)
    plain = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="enable_jit_fused: Sequential has no GPT-2 MLP"):
        apply_jit_fused(plain, ShardConfig(enable_jit_fused=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert apply_jit_fused(plain, ShardConfig(enable_all_optimization=True)) == []
    assert any("enable_jit_fused" in str(w.message) for w in caught)
