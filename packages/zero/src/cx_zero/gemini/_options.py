"""Validated GeminiDDP options: the constructor's loose arguments become one frozen dataclass with enums.

Validation happens here, once, so every bad argument fails before any chunk is built, with a message listing what is
accepted (ColossalAI asserts or silently ignores several of these).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["GeminiOptions", "PlacementKind", "SUPPORTED_PRECISIONS", "PlacementFractions"]

SUPPORTED_PRECISIONS = (torch.float32, torch.float16, torch.bfloat16)


class PlacementKind(enum.Enum):
    """Where chunks live: fixed fractions decided once (`static`) or a device budget from a warm-up trace (`auto`)."""

    STATIC = "static"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: str | PlacementKind) -> PlacementKind:
        if isinstance(value, PlacementKind):
            return value
        try:
            return cls(value)
        except ValueError:
            accepted = ", ".join(repr(k.value) for k in cls)
            raise ValueError(f"GeminiDDP: placement_policy={value!r} is not supported; accepted: {accepted}") from None


def _fraction(name: str, value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"GeminiDDP: {name} must be in [0, 1], got {value}")
    return float(value)


_STATIC_DEFAULTS = {"shard_param_frac": 1.0, "offload_optim_frac": 0.0, "offload_param_frac": 0.0}
_AUTO_DEFAULTS = {"warmup_non_model_data_ratio": 0.8, "steady_cuda_cap_ratio": 0.9}


@dataclass(frozen=True)
class PlacementFractions:
    """The placement knobs as given; `effective` keeps only those the chosen policy reads, naming the rest.

    ColossalAI ignores the static fractions under 'auto', the auto ratios under 'static', and `offload_param_frac`
    without full sharding and optimizer offload. cx accepts the same combinations so ColossalAI scripts run, and
    says once, in a warning, which values have no effect (they are reset to their defaults).
    """

    shard_param_frac: float
    offload_optim_frac: float
    offload_param_frac: float
    warmup_non_model_data_ratio: float
    steady_cuda_cap_ratio: float

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            _fraction(name, value)

    def effective(self, placement: PlacementKind) -> tuple[PlacementFractions, list[str]]:
        values = dict(self.__dict__)
        unused = _AUTO_DEFAULTS if placement is PlacementKind.STATIC else _STATIC_DEFAULTS
        ignored = [f"{name}={values[name]}" for name, default in unused.items() if values[name] != default]
        for name, default in unused.items():
            values[name] = default
        if (
            placement is PlacementKind.STATIC
            and values["offload_param_frac"] > 0
            and (values["shard_param_frac"] != 1.0 or values["offload_optim_frac"] != 1.0)
        ):
            ignored.append(
                f"offload_param_frac={values['offload_param_frac']} (needs shard_param_frac=1.0 and "
                "offload_optim_frac=1.0)"
            )
            values["offload_param_frac"] = 0.0
        return PlacementFractions(**values), ignored


@dataclass(frozen=True)
class GeminiOptions:
    """Every GeminiDDP setting after validation (see docs/gemini.md for what each one does)."""

    placement: PlacementKind
    mixed_precision: torch.dtype
    master_weights: bool
    enable_gradient_accumulation: bool
    max_prefetch: int
    shard_param_frac: float
    offload_optim_frac: float
    offload_param_frac: float
    warmup_non_model_data_ratio: float
    steady_cuda_cap_ratio: float
    search_range_m: float
    hidden_dim: int | None
    min_chunk_size_m: float
    pin_memory: bool
    force_outputs_fp32: bool
    strict_ddp_mode: bool

    def __post_init__(self) -> None:
        if self.mixed_precision not in SUPPORTED_PRECISIONS:
            accepted = ", ".join(str(d) for d in SUPPORTED_PRECISIONS)
            raise ValueError(
                f"GeminiDDP: mixed_precision={self.mixed_precision} is not supported; accepted: {accepted}"
            )
        if self.max_prefetch < 0:
            raise ValueError(f"GeminiDDP: max_prefetch must be >= 0, got {self.max_prefetch}")
        for name in (
            "shard_param_frac",
            "offload_optim_frac",
            "offload_param_frac",
            "warmup_non_model_data_ratio",
            "steady_cuda_cap_ratio",
        ):
            _fraction(name, getattr(self, name))
        if self.offload_param_frac > 0 and (self.shard_param_frac != 1.0 or self.offload_optim_frac != 1.0):
            raise ValueError(
                "GeminiDDP: offload_param_frac > 0 needs shard_param_frac=1.0 and offload_optim_frac=1.0 "
                f"(got shard_param_frac={self.shard_param_frac}, offload_optim_frac={self.offload_optim_frac})"
            )
        if self.placement is PlacementKind.AUTO and (
            self.shard_param_frac != 1.0 or self.offload_optim_frac != 0.0 or self.offload_param_frac != 0.0
        ):
            raise ValueError(
                "GeminiDDP: shard_param_frac / offload_optim_frac / offload_param_frac only apply to "
                "placement_policy='static'; leave them at their defaults (1.0, 0.0, 0.0) with 'auto'"
            )
        if self.placement is PlacementKind.STATIC and (
            self.warmup_non_model_data_ratio != 0.8 or self.steady_cuda_cap_ratio != 0.9
        ):
            raise ValueError(
                "GeminiDDP: warmup_non_model_data_ratio / steady_cuda_cap_ratio only apply to "
                "placement_policy='auto'; leave them at their defaults (0.8, 0.9) with 'static' "
                f"(got {self.warmup_non_model_data_ratio}, {self.steady_cuda_cap_ratio})"
            )
        if self.search_range_m < 0 or self.min_chunk_size_m < 0:
            raise ValueError(
                f"GeminiDDP: search_range_m ({self.search_range_m}) and min_chunk_size_m ({self.min_chunk_size_m}) "
                "must be >= 0"
            )
        if self.hidden_dim is not None and self.hidden_dim <= 0:
            raise ValueError(f"GeminiDDP: hidden_dim must be positive, got {self.hidden_dim}")
        if self.strict_ddp_mode and self.placement is not PlacementKind.STATIC:
            raise ValueError(
                "GeminiDDP: strict_ddp_mode=True (every chunk kept gathered) needs placement_policy='static'"
            )

    @property
    def needs_master(self) -> bool:
        """A separate fp32 master copy exists only for low-precision parameters with master_weights=True."""
        return self.master_weights and self.mixed_precision != torch.float32

    @property
    def needs_loss_scaling(self) -> bool:
        return self.mixed_precision == torch.float16
