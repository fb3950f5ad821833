"""The tensor-parallel layers' matmul in high precision or fp8: `fp8_recipe` None keeps `F.linear` exactly (the
plain path is untouched); a recipe computes with `cx_mesh.fp8.fp8_linear`. Set by `_fp8_switches.apply_fp8`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cx_mesh.fp8 import ScalingRecipe, fp8_linear

__all__ = ["maybe_fp8_linear"]


def maybe_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: ScalingRecipe | None
) -> torch.Tensor:
    """`F.linear` (recipe None) or its fp8 version; `weight` is [out, in] as F.linear takes it."""
    if recipe is None:
        return F.linear(x, weight, bias)
    return fp8_linear(x, weight, bias, recipe)
