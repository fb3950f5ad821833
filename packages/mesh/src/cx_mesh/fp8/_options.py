"""What `use_fp8` means for a model: `Fp8Options` (recipe, size filter, excluded names) and `fp8_eligible`."""

from __future__ import annotations

from dataclasses import dataclass

from cx_mesh.fp8._formats import ScalingRecipe

__all__ = ["Fp8Options", "fp8_eligible"]

#: fp8 GEMM kernels (cuBLASLt, torch._scaled_mm on CUDA) need both matrix dims to be multiples of 16.
FP8_ALIGNMENT = 16


@dataclass(frozen=True)
class Fp8Options:
    """Passed whole to every layer that honours use_fp8.

    Layers with in/out features below `min_features` stay in high precision (fp8's quantization costs more than it
    saves on small GEMMs); module names ending in one of `exclude` are never converted (torchtitan keeps the output
    layer in high precision, its logits feed the loss directly)."""

    recipe: ScalingRecipe = ScalingRecipe.TENSORWISE
    min_features: int = 16
    exclude: tuple[str, ...] = ("lm_head",)

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, ScalingRecipe):
            raise TypeError(f"Fp8Options.recipe must be a ScalingRecipe, got {self.recipe!r}")
        if self.min_features < 1:
            raise ValueError(f"Fp8Options.min_features must be at least 1, got {self.min_features}")
        if not isinstance(self.exclude, tuple):
            raise TypeError(f"Fp8Options.exclude is a tuple of name suffixes, got {self.exclude!r}")

    def excludes(self, name: str) -> bool:
        """Whether the module qualified as `name` stays in high precision: `exclude` names it or its last dotted
        parts (`lm_head` excludes `lm_head` and `model.lm_head`, not `my_lm_head`). The one match every use_fp8
        conversion applies (cx_mesh's Fp8Linear swap, ShardFormer's TP layers, FSDP's torchao swap)."""
        return any(name == suffix or name.endswith("." + suffix) for suffix in self.exclude)


def fp8_eligible(in_features: int, out_features: int, options: Fp8Options = Fp8Options()) -> bool:
    """Both dims >= options.min_features and multiples of 16 (what fp8 GEMM kernels need)."""
    return all(d >= options.min_features and d % FP8_ALIGNMENT == 0 for d in (in_features, out_features))
