"""enable_fused_normalization: each Hugging Face `*RMSNorm` replaced by torch's fused `nn.RMSNorm` over the same
weight Parameter, only where the two compute the same function.

Not every `*RMSNorm` is `x / rms(x) * weight`: Gemma's scales by `(1 + weight)` with weights starting at 0, so a
blind swap makes every norm output 0 and the logits constant, silently. Each class is therefore checked once: a
stand-in with a random weight and the module's own settings (eps and the like) runs the class's forward and torch's
`nn.RMSNorm` on a probe input, and a class whose outputs differ keeps its own module, with a warning naming it.
The hooks a policy put on a norm before the swap (sequence parallelism gathers the sequence after the final norm)
move to the fused module, so the swap changes the kernel and nothing else.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from cx_shardformer._sharder import set_submodule

__all__ = ["fuse_rms_norms"]

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
_PROBE_FEATURES = 16


def _epsilon(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return eps if isinstance(eps, float) else None


def computes_rms_norm(module: nn.Module) -> bool:
    """Whether `module`'s class computes `nn.RMSNorm(weight, eps)`: its forward on a stand-in (random weight, the
    module's plain attributes, no hooks, on the CPU in fp32, so a meta or sharded model can be checked too) against
    torch's, on a probe input, to fp32 rounding."""
    eps = _epsilon(module)
    if eps is None:
        return False
    generator = torch.Generator().manual_seed(0)
    stand_in = type(module).__new__(type(module))
    nn.Module.__init__(stand_in)
    for name, value in vars(module).items():
        if not name.startswith("_") and not isinstance(value, torch.Tensor | nn.Module):
            object.__setattr__(stand_in, name, value)
    cpu = torch.device("cpu")  # explicit: the model may be built under a meta device context
    weight = torch.randn(_PROBE_FEATURES, generator=generator, device=cpu)
    stand_in.weight = nn.Parameter(weight.clone())
    fused = nn.RMSNorm(_PROBE_FEATURES, eps=eps, device=cpu)
    probe = torch.randn(2, 3, _PROBE_FEATURES, generator=generator, device=cpu)
    try:
        with torch.no_grad():
            fused.weight.copy_(weight)
            want, got = type(module).forward(stand_in, probe), fused(probe)
    except (TypeError, AttributeError, RuntimeError):  # a forward that needs more than (hidden_states)
        return False
    return isinstance(want, torch.Tensor) and want.shape == got.shape and torch.allclose(want, got, 1e-5, 1e-6)


def fuse_rms_norms(model: nn.Module) -> int:
    """Replace every Hugging Face `*RMSNorm` that computes torch's RMSNorm by `nn.RMSNorm` holding the same
    Parameter and the same hooks; LayerNorm already runs torch's fused kernel. Returns how many were replaced."""
    replaced = 0
    verdicts: dict[type[nn.Module], bool] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.RMSNorm) or not type(module).__name__.endswith("RMSNorm"):
            continue
        weight, eps = getattr(module, "weight", None), _epsilon(module)
        if not isinstance(weight, nn.Parameter) or eps is None or weight.dim() != 1:
            raise TypeError(f"enable_fused_normalization: cannot fuse {type(module).__name__} at {name!r}")
        cls = type(module)
        if cls not in verdicts:
            verdicts[cls] = computes_rms_norm(module)
            if not verdicts[cls]:
                warnings.warn(
                    f"enable_fused_normalization: {cls.__name__} does not compute torch's RMSNorm "
                    "(x / rms(x) * weight), so it keeps its own forward (unfused)",
                    stacklevel=2,
                )
        if not verdicts[cls]:
            continue
        fused = nn.RMSNorm(weight.shape[0], eps=eps, elementwise_affine=True, device=weight.device, dtype=weight.dtype)
        fused.weight = weight
        for hooks in _HOOK_DICTS:  # the same dicts: the policies' hook handles keep working
            setattr(fused, hooks, getattr(module, hooks))
        set_submodule(model, name, fused)
        replaced += 1
    return replaced
