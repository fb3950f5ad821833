"""`LossScaleOptions`: ColossalAI's seven loss-scale arguments as one validated group.

The ZeRO plugins, `LowLevelZeroOptimizer` and `GeminiOptimizer` all take these arguments flat (ColossalAI's names
and defaults, which differ between them); each turns them into this group once, and the group builds the scaler.
"""

from __future__ import annotations

from dataclasses import dataclass

from cx_zero._grad_scaler import BaseGradScaler, ConstantGradScaler, DynamicGradScaler

__all__ = ["LossScaleOptions"]


@dataclass(frozen=True)
class LossScaleOptions:
    """Dynamic loss scaling for fp16 (rules in `DynamicGradScaler`); other precisions train unscaled.

    Fields are in ColossalAI's argument order, so a constructor may pass its flat arguments positionally.
    """

    initial_scale: float = 2**16
    min_scale: float = 1
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    max_scale: float = 2**32

    def __post_init__(self) -> None:
        self.scaler(dynamic=True)  # the scaler's own checks, once, whatever the precision

    def scaler(self, dynamic: bool) -> BaseGradScaler:
        """A fresh scaler: dynamic with these settings (fp16), or the constant 1.0 (fp32, bf16)."""
        if not dynamic:
            return ConstantGradScaler(1.0)
        return DynamicGradScaler(
            initial_scale=self.initial_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            hysteresis=self.hysteresis,
        )
