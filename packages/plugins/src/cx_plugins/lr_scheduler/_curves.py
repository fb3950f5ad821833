"""The learning-rate curves of ColossalAI's schedulers as closed-form functions of the step.

Each curve is a small frozen dataclass called with the step index (torch's `last_epoch`) and returning the learning
rate for one parameter group whose base rate is `base`. Scheduler state dicts hold only the position (plain data
that checkpoints store as JSON); the curve is rebuilt from the constructor's arguments, as for torch's lambdas.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Warmup:
    """Linear warm-up over `steps` steps, ColossalAI's convention: step s (< steps) runs at (s + 1) / steps."""

    steps: int

    def active(self, step: int) -> bool:
        return step < self.steps

    def factor(self, step: int) -> float:
        return (step + 1) / self.steps


@dataclasses.dataclass(frozen=True)
class Cosine:
    """From `base` down to `floor` along half a cosine over `length` steps, then `floor`."""

    length: int
    floor: float

    def rate(self, base: float, step: int) -> float:
        progress = min(step, self.length) / self.length if self.length > 0 else 1.0
        return self.floor + (base - self.floor) * (1 + math.cos(math.pi * progress)) / 2


@dataclasses.dataclass(frozen=True)
class Polynomial:
    """From `base` to `end` as (1 - s / length) ** power, then `end`."""

    length: int
    end: float
    power: float

    def rate(self, base: float, step: int) -> float:
        remaining = 1 - min(step, self.length) / self.length if self.length > 0 else 0.0
        return float((base - self.end) * remaining**self.power + self.end)


@dataclasses.dataclass(frozen=True)
class Steps:
    """`gamma` to the power of the milestones passed."""

    milestones: tuple[int, ...]
    gamma: float

    def rate(self, base: float, step: int) -> float:
        return base * self.gamma ** sum(1 for m in self.milestones if step >= m)


Decay = Cosine | Polynomial | Steps


@dataclasses.dataclass(frozen=True)
class Curve:
    """Warm-up (optional), a flat stretch (optional), then a decay; called as a `LambdaLR` factor of `base`."""

    base: float
    decay: Decay
    warmup: Warmup | None = None
    flat: int = 0

    def __call__(self, step: int) -> float:
        if self.base == 0:
            return 0.0
        if self.warmup is not None and self.warmup.active(step):
            return self.warmup.factor(step)
        start = (self.warmup.steps if self.warmup is not None else 0) + self.flat
        if step < start:
            return 1.0
        return self.decay.rate(self.base, step - start) / self.base


@dataclasses.dataclass(frozen=True)
class LinearWarmupDecay:
    """ColossalAI's LinearWarmupLR: up as (s + 1) / (warmup + 1), then down linearly to zero at `total`."""

    total: int
    warmup: int

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        return max(self.total - step, 0) / (self.total - self.warmup)
