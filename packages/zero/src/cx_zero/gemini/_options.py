"""Validated Gemini options: GeminiDDP's and GeminiOptimizer's loose arguments as frozen dataclasses with enums.

`GeminiOptions.from_arguments` is the one place ColossalAI's flat GeminiDDP keywords become the group (GeminiDDP's
constructor and GeminiPlugin both call it); `GeminiOptimizerOptions` groups the optimizer's loss scaling, clipping
and device margin. Validation happens here, once, so every bad argument fails before any chunk is built, with a
message listing what is accepted (ColossalAI asserts or silently ignores several of these).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from cx_chunk import ChunkConfig
from cx_zero._clipping import ClipOptions
from cx_zero._loss_scale import LossScaleOptions
from cx_zero._precision import Precision

__all__ = ["GeminiOptimizerOptions", "GeminiOptions", "PlacementFractions", "PlacementKind", "read_chunk_config"]

_CHUNK_KEYS = frozenset({"chunk_size", "keep_gathered", "separate_above"})


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
    chunk_config: ChunkConfig | None = None
    """ColossalAI's `chunk_config_dict`, read (the chunk size is rounded up to the zero group's size at wrap time);
    None: the chunk size is searched."""
    chunk_init_device: torch.device | None = None
    enable_async_reduce: bool = True
    fp8_communication: bool = False
    """Chunk gradient reductions in fp8 (E5M2) and the all-gather of master-backed parameter chunks in fp8 (E4M3),
    through `cx_mesh.fp8` (see cx_chunk's Chunk); needs fp32 master weights."""

    def __post_init__(self) -> None:
        if self.chunk_config is not None and (
            self.search_range_m != 32 or self.min_chunk_size_m != 32 or self.hidden_dim is not None
        ):
            raise ValueError(
                "GeminiDDP: search_range_m, min_chunk_size_m and hidden_dim configure the chunk-size search; "
                "they do not apply when chunk_config_dict is given (pass one or the other)"
            )
        Precision.parse(self.mixed_precision, what="GeminiDDP: mixed_precision")
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
        if self.fp8_communication and not self.needs_master:
            raise ValueError(
                "GeminiDDP: fp8_communication=True needs fp32 master weights (mixed_precision fp16 or bf16 with "
                f"master_weights=True; got mixed_precision={self.mixed_precision}, master_weights="
                f"{self.master_weights}): without them each fp8 all-gather would round the only copy of the weights"
            )
        if self.strict_ddp_mode and self.placement is not PlacementKind.STATIC:
            raise ValueError(
                "GeminiDDP: strict_ddp_mode=True (every chunk kept gathered) needs placement_policy='static'"
            )

    @classmethod
    def from_arguments(
        cls,
        chunk_config_dict: Mapping[Any, Any] | None = None,
        chunk_init_device: torch.device | None = None,
        placement_policy: str | PlacementKind = "static",
        enable_gradient_accumulation: bool = False,
        max_prefetch: int = 0,
        shard_param_frac: float = 1.0,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        warmup_non_model_data_ratio: float = 0.8,
        steady_cuda_cap_ratio: float = 0.9,
        search_range_m: float = 32,
        hidden_dim: int | None = None,
        min_chunk_size_m: float = 32,
        pin_memory: bool = False,
        force_outputs_fp32: bool = False,
        strict_ddp_mode: bool = False,
        mixed_precision: torch.dtype = torch.float16,
        master_weights: bool = True,
        enable_async_reduce: bool = True,
        fp8_communication: bool = False,
    ) -> GeminiOptions:
        """ColossalAI's GeminiDDP keywords (its names and defaults) as the validated group. Placement knobs the
        chosen policy does not read are reset to their defaults with one warning naming them, as ColossalAI ignores
        them."""
        placement = PlacementKind.parse(placement_policy)
        fractions, ignored = PlacementFractions(
            shard_param_frac=shard_param_frac,
            offload_optim_frac=offload_optim_frac,
            offload_param_frac=offload_param_frac,
            warmup_non_model_data_ratio=warmup_non_model_data_ratio,
            steady_cuda_cap_ratio=steady_cuda_cap_ratio,
        ).effective(placement)
        if ignored:
            warnings.warn(
                f"GeminiDDP(placement_policy={placement.value!r}) ignores {', '.join(ignored)}, as ColossalAI does",
                stacklevel=3,
            )
        return cls(
            placement=placement,
            mixed_precision=mixed_precision,
            master_weights=master_weights,
            enable_gradient_accumulation=enable_gradient_accumulation,
            max_prefetch=max_prefetch,
            search_range_m=search_range_m,
            hidden_dim=hidden_dim,
            min_chunk_size_m=min_chunk_size_m,
            pin_memory=pin_memory,
            force_outputs_fp32=force_outputs_fp32,
            strict_ddp_mode=strict_ddp_mode,
            chunk_config=None if chunk_config_dict is None else read_chunk_config(chunk_config_dict),
            chunk_init_device=None if chunk_init_device is None else torch.device(chunk_init_device),
            enable_async_reduce=enable_async_reduce,
            fp8_communication=fp8_communication,
            **fractions.__dict__,
        )

    @property
    def precision(self) -> Precision:
        return Precision.parse(self.mixed_precision)

    @property
    def needs_master(self) -> bool:
        """A separate fp32 master copy exists only for low-precision parameters with master_weights=True."""
        return self.master_weights and self.mixed_precision != torch.float32

    @property
    def needs_loss_scaling(self) -> bool:
        return self.precision.needs_loss_scaling


def read_chunk_config(config: Mapping[Any, Any]) -> ChunkConfig:
    """`{"chunk_size": n, "keep_gathered": b}` or ColossalAI's `{group_size: {...}}` form -> `ChunkConfig`."""
    if "chunk_size" not in config and len(config) == 1 and isinstance(next(iter(config.values())), Mapping):
        config = next(iter(config.values()))
    unknown = set(config) - _CHUNK_KEYS
    if unknown or "chunk_size" not in config:
        raise ValueError(
            f"GeminiDDP: chunk_config_dict must have 'chunk_size' and may have 'keep_gathered', 'separate_above' "
            f"(got keys {sorted(map(str, config))})"
        )
    size = int(config["chunk_size"])
    if size <= 0:
        raise ValueError(f"GeminiDDP: chunk_config_dict chunk_size must be positive, got {size}")
    return ChunkConfig(size, bool(config.get("keep_gathered", False)), config.get("separate_above"))


@dataclass(frozen=True)
class GeminiOptimizerOptions:
    """GeminiOptimizer's settings: fp16 loss scaling, clipping by global norm, and (auto placement) the share of
    free device memory optimizer chunks may use."""

    loss_scale: LossScaleOptions = field(default_factory=LossScaleOptions)
    clipping: ClipOptions = field(default_factory=ClipOptions)
    gpu_margin_mem_ratio: float = 0.0
    optimizer_states_dtype: torch.dtype = torch.float32
    """Adam's moments in fp32 or bf16 with stochastic rounding (`cx_zero.Bf16StateAdam`): half their bytes."""
    stochastic_rounding_seed: int = 0

    def __post_init__(self) -> None:
        if self.optimizer_states_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                "GeminiOptimizer: optimizer_states_dtype must be float32 or bfloat16, "
                f"got {self.optimizer_states_dtype}"
            )
        if not 0.0 <= self.gpu_margin_mem_ratio <= 1.0:
            raise ValueError(
                f"GeminiOptimizer: gpu_margin_mem_ratio must be in [0, 1], got {self.gpu_margin_mem_ratio}"
            )
