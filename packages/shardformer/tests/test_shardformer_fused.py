"""enable_jit_fused: the compiled kernels (`_fused`) against the unfused transformers ops, forward and backward,
dropout with the same mask; the policy rules (what is fused, nothing to fuse, enable_all_optimization). The
model-level runs (tp 2, HybridParallelPlugin and GeminiPlugin) are in cx-plugins. Inductor, the real backend, builds
bias + GELU (the kernel with a transcendental function, where its code generation could round differently); the
other kernels use aot_eager, which traces them the same way without generating code (inductor took 85 s for all five
on a loaded 2-core machine, 25 s for this one).

Tolerance from the arithmetic: a kernel evaluates the same element-wise ops (at most about ten roundings of at most
one unit each) except that inductor's vectorised tanh / exp / rsqrt may differ from ATen's by a few units in the last
place, and RMSNorm's 32-term mean may add in another order; on O(1) values that stays within 32 units of fp32
roundoff (2**-19), relative or absolute. Dropout masks must be identical: an element is zero in both or in neither.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from cx_shardformer import ShardConfig
from cx_shardformer._fused import bias_act, bias_dropout_add, compile_backend, rms_norm, swiglu
from cx_shardformer.policies._fused import apply_jit_fused

transformers = pytest.importorskip("transformers")

TOL = 2.0**-19  # 32 units of fp32 roundoff (module docs)


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def _named(what: str) -> Callable[[str], str]:
    return lambda message: f"{what}: {message}"


def _check(fused: torch.Tensor, plain: torch.Tensor, inputs: list[torch.Tensor], what: str) -> None:
    torch.testing.assert_close(fused, plain, rtol=TOL, atol=TOL, msg=lambda m: f"{what} forward: {m}")
    grad = torch.randn_like(plain)
    fused_grads = torch.autograd.grad(fused, inputs, grad)
    plain_grads = torch.autograd.grad(plain, inputs, grad)
    for i, (a, b) in enumerate(zip(fused_grads, plain_grads, strict=True)):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=_named(f"{what} grad {i}"))


@pytest.mark.slow
def test_shardformer_fused_kernels_match_unfused_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.activations import NewGELUActivation
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    monkeypatch.delenv("CX_JIT_FUSED_BACKEND", raising=False)
    assert compile_backend() == "inductor"
    torch.manual_seed(0)
    x, bias, residual = _leaf(2, 8, 32), _leaf(32), _leaf(2, 8, 32)
    gelu = NewGELUActivation()
    _check(bias_act(x, bias, gelu), gelu(x + bias), [x, bias], "bias + GELU")

    monkeypatch.setenv("CX_JIT_FUSED_BACKEND", "aot_eager")

    dropout = nn.Dropout(0.25).train()
    torch.manual_seed(7)
    fused = bias_dropout_add(x, bias, dropout, residual)
    torch.manual_seed(7)
    plain = residual + dropout(x + bias)
    assert torch.equal(fused == residual, plain == residual), "the same elements dropped"
    _check(fused, plain, [x, bias, residual], "bias + dropout + residual")
    _check(bias_dropout_add(x, bias, dropout.eval()), x + bias, [x, bias], "bias + dropout (eval)")

    gate, up, silu = _leaf(2, 8, 48), _leaf(2, 8, 48), nn.SiLU()
    _check(swiglu(gate, up, silu), silu(gate) * up, [gate, up], "SwiGLU")

    norm = LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32) + 0.5)
    _check(rms_norm(x, norm.weight, 1e-6), norm(x), [x, norm.weight], "RMSNorm")


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
