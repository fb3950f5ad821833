"""`ClipOptions`: clipping by global gradient norm (ColossalAI's `max_norm` / `clip_grad_norm` and `norm_type`)."""

from __future__ import annotations

from dataclasses import dataclass

from cx_zero._norm import NormType

__all__ = ["ClipOptions"]


@dataclass(frozen=True)
class ClipOptions:
    """Clip every step so that the global gradient norm is at most `max_norm` (0 disables clipping); `norm_type`
    is also the norm `get_grad_norm` reports."""

    max_norm: float = 0.0
    norm_type: NormType = NormType.TWO

    def __post_init__(self) -> None:
        if not self.max_norm >= 0:  # NaN too: it would disable clipping silently
            raise ValueError(f"max_norm must be >= 0 (0 disables clipping), got {self.max_norm}")

    @classmethod
    def of(cls, max_norm: float, norm_type: float | str | NormType, name: str = "max_norm") -> ClipOptions:
        """From ColossalAI's flat arguments (`norm_type` 2, 2.0, "2", inf or "inf"); `name` is the caller's name
        for `max_norm` in the error (`LowLevelZeroOptimizer` calls it `clip_grad_norm`)."""
        if not max_norm >= 0:
            raise ValueError(f"{name} must be >= 0 (0 disables clipping), got {max_norm}")
        return cls(float(max_norm), NormType.parse(norm_type))

    @property
    def enabled(self) -> bool:
        return self.max_norm > 0
