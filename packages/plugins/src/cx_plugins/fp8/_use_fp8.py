"""`use_fp8` for the plugins whose model holds plain `nn.Linear` layers (LowLevelZero, Gemini): the eligible ones
become `cx_mesh.fp8.Fp8Linear` (fp8 matmuls with dynamic scaling; parameters, hooks and state-dict keys unchanged)
before the plugin wraps the model. Layers too small, with dims that are not multiples of 16, or named `lm_head` stay
in high precision (`cx_mesh.fp8.Fp8Options`, as torchtitan's filter).
"""

from __future__ import annotations

import warnings

from torch import nn

from cx_mesh import get_accelerator
from cx_mesh.fp8 import Fp8Options, ScalingRecipe, convert_to_fp8, fp8_matmul_supported

__all__ = ["check_fp8_recipe", "convert_linears_to_fp8", "warn_nothing_converted"]


def check_fp8_recipe(owner: str, use_fp8: bool, fp8_recipe: ScalingRecipe) -> ScalingRecipe:
    """Every plugin's `fp8_recipe` (how use_fp8 scales: TENSORWISE, ROWWISE or BLOCKWISE), checked where the plugin
    is built: a ScalingRecipe, and one other than the default only together with use_fp8=True (it would change
    nothing otherwise, silently)."""
    if not isinstance(fp8_recipe, ScalingRecipe):
        raise TypeError(f"{owner}: fp8_recipe must be a cx_mesh.fp8.ScalingRecipe, got {fp8_recipe!r}")
    if fp8_recipe is not ScalingRecipe.TENSORWISE and not use_fp8:
        raise ValueError(f"{owner}(fp8_recipe={fp8_recipe.name}) takes effect only with use_fp8=True")
    return fp8_recipe


def convert_linears_to_fp8(model: nn.Module, owner: str, options: Fp8Options | None = None) -> list[str]:
    """Convert `model`'s eligible plain Linear layers in place; returns their names. An accelerator without fp8
    GEMMs is a ValueError naming `owner`'s switch. When nothing in the model
    computes in fp8 afterwards (no layer converted here, and no tensor-parallel layer that ShardFormer's use_fp8
    switched, which carries a `fp8_recipe`), a warning names `owner`'s switch: use_fp8=True changed nothing."""
    device = get_accelerator().current_device()
    if not fp8_matmul_supported(device):  # fail at boost, not at the first forward
        raise ValueError(
            f"{owner}(use_fp8=True): fp8 matmuls do not run on {device} (torch._scaled_mm needs the CPU or a CUDA GPU "
            "of compute capability 8.9 or newer); pass use_fp8=False"
        )
    converted = convert_to_fp8(model, options if options is not None else Fp8Options())
    tensor_parallel = any(getattr(module, "fp8_recipe", None) is not None for module in model.modules())
    if not converted and not tensor_parallel:
        warn_nothing_converted(owner, stacklevel=3)
    return converted


def warn_nothing_converted(owner: str, stacklevel: int) -> None:
    """The one warning for a use_fp8=True that converted no layer (every plugin's swap, cx_mesh's or torchao's):
    the switch changed nothing, which is allowed (ColossalAI's examples pass it to any model) but never silent.
    `stacklevel` counts from the caller of this function (1: that caller), as warnings.warn counts from itself."""
    warnings.warn(
        f"{owner}(use_fp8=True): no layer was converted to fp8 (fp8 takes plain nn.Linear layers whose in and "
        "out features are multiples of 16 and at least 16, not named lm_head); the model computes as before",
        UserWarning,
        stacklevel=stacklevel + 1,
    )
