"""`LowLevelZeroOptions`: the validated, frozen form of `LowLevelZeroOptimizer`'s keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from cx_zero._clipping import ClipOptions
from cx_zero._loss_scale import LossScaleOptions
from cx_zero._precision import Precision

__all__ = ["LowLevelZeroOptions", "ZeroStage", "parse_states_dtype"]

_STATES_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_states_dtype(value: str | torch.dtype, who: str) -> torch.dtype:
    """The public `optimizer_states_dtype` (\"fp32\" or \"bf16\", or the torch dtype) as a torch dtype."""
    if isinstance(value, torch.dtype) and value in _STATES_DTYPES.values():
        return value
    if isinstance(value, str) and value in _STATES_DTYPES:
        return _STATES_DTYPES[value]
    raise ValueError(f"{who}: optimizer_states_dtype must be one of {sorted(_STATES_DTYPES)}, got {value!r}")


class ZeroStage(Enum):
    """ZeRO-1 partitions master weights and optimizer state; ZeRO-2 partitions the reduced gradients too."""

    ONE = 1
    TWO = 2


@dataclass(frozen=True)
class LowLevelZeroOptions:
    """Every tuning knob of the optimizer, checked once at construction (the loss scale and clipping as their own
    groups, shared with Gemini)."""

    # LowLevelZeroOptimizer's own (ColossalAI's) defaults, which differ from GeminiOptimizer's in two places
    loss_scale: LossScaleOptions = field(
        default_factory=lambda: LossScaleOptions(growth_interval=2000, max_scale=2**24)
    )
    clipping: ClipOptions = field(default_factory=ClipOptions)
    verbose: bool = False
    reduce_bucket_size: int = 1024 * 1024
    communication_dtype: torch.dtype | None = None
    overlap_communication: bool = False
    stage: ZeroStage = ZeroStage.ONE
    cpu_offload: bool = False
    forced_dtype: torch.dtype | None = None
    master_weights: bool = True
    overlap_allgather: bool = False
    fp8_communication: bool = False
    """Gradient buckets reduced in fp8 (E5M2) and updated parameters all-gathered in fp8 (E4M3), through
    `cx_mesh.fp8`'s collectives (as ColossalAI's switch); the master weights stay full precision."""
    optimizer_states_dtype: torch.dtype = torch.float32
    """Adam's moments in fp32 (as the wrapped optimizer keeps them) or bf16 with stochastic rounding
    (`_bf16_states`), half their bytes; the wrapped optimizer must then be Adam(W)."""
    stochastic_rounding_seed: int = 0
    """Seeds the bf16 states' stochastic rounding (with the step and the parameter: reproducible, resumable)."""

    def __post_init__(self) -> None:
        if self.reduce_bucket_size < 1:
            raise ValueError(f"reduce_bucket_size must be a positive number of elements, got {self.reduce_bucket_size}")
        for name in ("communication_dtype", "forced_dtype"):
            value = getattr(self, name)
            if value is not None:
                Precision.parse(value, what=name)
        if self.optimizer_states_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"optimizer_states_dtype must be float32 or bfloat16, got {self.optimizer_states_dtype}")
