"""`LowLevelZeroOptions`: the validated, frozen form of `LowLevelZeroOptimizer`'s keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from cx_zero._norm import NormType

__all__ = ["LowLevelZeroOptions", "ZeroStage", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ZeroStage(Enum):
    """ZeRO-1 partitions master weights and optimizer state; ZeRO-2 partitions the reduced gradients too."""

    ONE = 1
    TWO = 2


@dataclass(frozen=True)
class LowLevelZeroOptions:
    """Every tuning knob of the optimizer, checked once at construction."""

    initial_scale: float = 2**16
    min_scale: float = 1
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 2
    max_scale: float = 2**24
    clip_grad_norm: float = 0.0
    norm_type: NormType = NormType.TWO
    verbose: bool = False
    reduce_bucket_size: int = 1024 * 1024
    communication_dtype: torch.dtype | None = None
    overlap_communication: bool = False
    stage: ZeroStage = ZeroStage.ONE
    cpu_offload: bool = False
    forced_dtype: torch.dtype | None = None
    master_weights: bool = True
    overlap_allgather: bool = False

    def __post_init__(self) -> None:
        if self.reduce_bucket_size < 1:
            raise ValueError(f"reduce_bucket_size must be a positive number of elements, got {self.reduce_bucket_size}")
        if not self.clip_grad_norm >= 0:  # NaN too: it would disable clipping silently
            raise ValueError(f"clip_grad_norm must be >= 0 (0 disables clipping), got {self.clip_grad_norm}")
        for name in ("communication_dtype", "forced_dtype"):
            value = getattr(self, name)
            if value is not None and value not in SUPPORTED_DTYPES:
                raise ValueError(f"{name} must be one of {SUPPORTED_DTYPES} or None, got {value}")
