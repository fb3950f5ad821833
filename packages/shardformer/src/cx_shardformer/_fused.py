"""enable_jit_fused: the element-wise chains around the transformer matmuls as single kernels, built with
torch.compile: bias + activation, bias + dropout, act(gate) * up and RMSNorm. ColossalAI's TorchScript fusion also
adds the residual into its bias + dropout kernel; here the residual adds stay in transformers' block code, which
the policies leave alone (`policies._fused`), so no kernel takes a residual.

Each kernel is a module-level function compiled once and cached by torch.compile per input shape (dynamo marks a
dimension dynamic after it has seen it change, so varying sequence lengths do not compile again and again). The
math is the unfused code's, op for op; the compiled kernel may round differently (inductor's own vectorised tanh /
exp, one pass instead of several), so element-wise results agree with the unfused ops within a few units in the
last place, and RMSNorm's mean of squares within what summing its terms in another order gives.

Dropout: the mask is not drawn inside the compiled code (inductor's RNG differs from eager's): the caller passes
`dropout(ones)`, computed by the model's own dropout module, so it comes from the same random stream (cx's dropout
streams, `_rng`) and equals the unfused mask bit for bit; eager dropout is `x * that mask` exactly.

`CX_JIT_FUSED_BACKEND` (default "inductor") picks torch.compile's backend, read when a kernel is first built; tests
use "aot_eager" (no code generation) except the one that checks inductor itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["bias_act", "bias_dropout", "compile_backend", "rms_norm", "swiglu"]

_KERNELS: dict[tuple[str, Any], Callable[..., torch.Tensor]] = {}


def compile_backend() -> str:
    """torch.compile's backend for the fused kernels: $CX_JIT_FUSED_BACKEND, default inductor."""
    return os.environ.get("CX_JIT_FUSED_BACKEND", "inductor")


def _kernel(name: str, key: Any, build: Callable[[], Callable[..., torch.Tensor]]) -> Callable[..., torch.Tensor]:
    backend = compile_backend()
    found = _KERNELS.get((name, (key, backend)))
    if found is None:
        found = torch.compile(build(), backend=backend)
        _KERNELS[(name, (key, backend))] = found
    return found


def _act_key(act: nn.Module, what: str) -> tuple[type, tuple[tuple[str, Any], ...]]:
    """Activations with the same class and settings share one compiled kernel; one with parameters or buffers is
    refused (the kernel keeps the first instance it was built with)."""
    if any(True for _ in act.parameters()) or any(True for _ in act.buffers()):
        raise ValueError(f"enable_jit_fused: {what} activation {type(act).__name__} has parameters; cannot fuse it")
    settings = sorted((k, v) for k, v in vars(act).items() if isinstance(v, int | float | str | bool | None))
    return type(act), tuple(settings)


def bias_act(x: torch.Tensor, bias: torch.Tensor | None, act: nn.Module) -> torch.Tensor:
    """`act(x + bias)` as one kernel (GPT-2's bias + GELU). One compiled kernel per activation class."""

    def build() -> Callable[..., torch.Tensor]:
        def fused(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            out: torch.Tensor = act(x if bias is None else x + bias)
            return out

        return fused

    return _kernel("bias_act", _act_key(act, "bias +"), build)(x, bias)


def _bias_dropout(x: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
    out = x if bias is None else x + bias
    return out if mask is None else out * mask


def bias_dropout(x: torch.Tensor, bias: torch.Tensor | None, dropout: nn.Module) -> torch.Tensor:
    """`dropout(x + bias)` as one kernel (GPT-2's c_proj bias + dropout, no residual); the mask is `dropout(ones)`
    from the model's own dropout module (its random stream, its rate, its training flag), so it is the unfused
    path's mask exactly."""
    p = float(getattr(dropout, "p", 0.0))
    mask = dropout(torch.ones_like(x)) if dropout.training and p > 0.0 else None
    return _kernel("bias_dropout", None, lambda: _bias_dropout)(x, bias, mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, act: nn.Module) -> torch.Tensor:
    """`act(gate) * up` as one kernel (Llama's SwiGLU with its own activation)."""

    def build() -> Callable[..., torch.Tensor]:
        def fused(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = act(gate) * up
            return out

        return fused

    return _kernel("swiglu", _act_key(act, "gated"), build)(gate, up)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op: float32 statistics, the weight applied in the input's dtype."""
    dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm as one kernel."""
    return _kernel("rms_norm", None, lambda: _rms_norm)(x, weight, eps)
