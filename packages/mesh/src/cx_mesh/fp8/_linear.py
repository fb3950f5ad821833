"""`Fp8Linear` (an nn.Linear whose forward is `fp8_linear`) and `convert_to_fp8`, which swaps eligible layers in place.

The swap changes only the class of each module: parameters, hooks, state_dict keys and any wrapper that already
holds the parameters (ZeRO, Gemini chunks, FSDP) stay as they are, so conversion may happen before or after sharding.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from cx_mesh.fp8._formats import ScalingRecipe
from cx_mesh.fp8._matmul import fp8_linear
from cx_mesh.fp8._options import Fp8Options, fp8_eligible

__all__ = ["Fp8Linear", "convert_to_fp8"]


class Fp8Linear(nn.Linear):
    """nn.Linear computed in fp8 (`fp8_linear`, dynamic scaling); same parameters, same state_dict."""

    recipe: ScalingRecipe = ScalingRecipe.TENSORWISE

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return fp8_linear(input, self.weight, self.bias, self.recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.value}"


_DEFAULT_OPTIONS = Fp8Options()


def convert_to_fp8(module: nn.Module, options: Fp8Options = _DEFAULT_OPTIONS) -> list[str]:
    """Swap, in place, every plain torch.nn.Linear submodule that `fp8_eligible` accepts and `options.excludes`
    does not name (by suffix of its qualified name) into Fp8Linear; returns the converted names. Idempotent: a layer
    that is already an Fp8Linear is left alone and not listed. Subclasses of nn.Linear (cx's TP layers, LoRA and the
    like) are not plain and are left to their owners, which call `fp8_linear` themselves."""
    converted: list[str] = []
    for name, child in module.named_modules():
        if type(child) is not nn.Linear:
            continue
        if options.excludes(name):
            continue
        if not fp8_eligible(child.in_features, child.out_features, options):
            continue
        child.__class__ = Fp8Linear
        assert isinstance(child, Fp8Linear)
        child.recipe = options.recipe
        converted.append(name)
    return converted
