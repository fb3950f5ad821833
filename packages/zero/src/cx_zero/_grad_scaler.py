"""Loss scalers for fp16 training: a constant one and a dynamic one with hysteresis.

The dynamic scaler's rules (ColossalAI's arguments, with the hysteresis counter behaving as documented here):
- an overflow step resets the growth counter and counts one overflow; when `hysteresis` overflows have been counted
  since the last backoff or growth, the scale is multiplied by `backoff_factor` (never below `min_scale`) and the
  overflow counter is reset to 0, so the next backoff again needs `hysteresis` overflows;
- a clean step counts one growth step; after `growth_interval` consecutive clean steps the scale is multiplied by
  `growth_factor` (never above `max_scale`) and both counters are reset.
Every overflow step is skipped by the optimizer whether or not it backs the scale off.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

__all__ = ["BaseGradScaler", "ConstantGradScaler", "DynamicGradScaler"]


class BaseGradScaler(ABC):
    """The interface optimizers use: the current `scale`, `update(overflow)` and (de)serialisation."""

    def __init__(self, initial_scale: float) -> None:
        if not initial_scale > 0:
            raise ValueError(f"initial_scale must be positive, got {initial_scale}")
        self._scale = float(initial_scale)

    @property
    def scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        return self._scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self._scale

    def scale_tensor(self) -> torch.Tensor:
        """The scale as a float32 scalar tensor (for multiplying a loss)."""
        return torch.tensor(self._scale, dtype=torch.float32)

    @abstractmethod
    def update(self, overflow: bool) -> None:
        """Record the outcome of one step (whether any gradient was inf/nan)."""

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self._scale}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        if "scale" not in state:
            raise KeyError(f"grad scaler state needs a 'scale' entry, got keys {sorted(state)}")
        self._scale = float(state["scale"])


class ConstantGradScaler(BaseGradScaler):
    """A fixed loss scale (1.0 disables scaling, as used for bf16 and fp32)."""

    def __init__(self, initial_scale: float = 1.0) -> None:
        super().__init__(initial_scale)

    def update(self, overflow: bool) -> None:
        """A constant scale ignores overflows (the step is still skipped by the optimizer)."""


class DynamicGradScaler(BaseGradScaler):
    """Grows the scale after `growth_interval` clean steps, backs off after `hysteresis` overflows (module doc)."""

    def __init__(
        self,
        initial_scale: float = 2**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int = 2,
    ) -> None:
        super().__init__(initial_scale)
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis}")
        if min_scale is not None and not min_scale > 0:
            raise ValueError(f"min_scale must be positive, got {min_scale}")
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"min_scale {min_scale} is larger than max_scale {max_scale}")
        if min_scale is not None and initial_scale < min_scale:
            raise ValueError(f"initial_scale {initial_scale} is below min_scale {min_scale}")
        if max_scale is not None and initial_scale > max_scale:
            raise ValueError(f"initial_scale {initial_scale} is above max_scale {max_scale}")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = None if min_scale is None else float(min_scale)
        self.max_scale = None if max_scale is None else float(max_scale)
        self.hysteresis = int(hysteresis)
        self._growth_step = 0
        self._overflow_count = 0

    @property
    def growth_step(self) -> int:
        """Consecutive clean steps since the last overflow or growth."""
        return self._growth_step

    @property
    def overflow_count(self) -> int:
        """Overflows counted since the last backoff or growth."""
        return self._overflow_count

    def update(self, overflow: bool) -> None:
        if overflow:
            self._growth_step = 0
            self._overflow_count += 1
            if self._overflow_count >= self.hysteresis:
                self._scale *= self.backoff_factor
                if self.min_scale is not None:
                    self._scale = max(self._scale, self.min_scale)
                self._overflow_count = 0
        else:
            self._growth_step += 1
            if self._growth_step >= self.growth_interval:
                self._scale *= self.growth_factor
                if self.max_scale is not None:
                    self._scale = min(self._scale, self.max_scale)
                self._growth_step = 0
                self._overflow_count = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self._scale, "growth_step": self._growth_step, "overflow_count": self._overflow_count}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        super().load_state_dict(state)
        self._growth_step = int(state.get("growth_step", 0))
        self._overflow_count = int(state.get("overflow_count", 0))
