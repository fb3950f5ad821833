"""ColossalAI's learning-rate schedulers (`colossalai.nn.lr_scheduler`) with their constructor arguments, built on
torch's own schedulers so that `state_dict` / `load_state_dict` and `get_last_lr` work as torch's do.

Every scheduler takes `total_steps` second, as ColossalAI's do (the torch-backed ones accept and ignore it, as
ColossalAI does). Warm-up schedules follow ColossalAI's curve: step s of a w-step warm-up runs at (s + 1) / w of
the base rate, then the decay starts from the base rate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.optim import Optimizer
from torch.optim import lr_scheduler as torch_schedulers

from cx_plugins.lr_scheduler._curves import Cosine, Curve, Decay, LinearWarmupDecay, Polynomial, Steps, Warmup

__all__ = [
    "CosineAnnealingLR",
    "CosineAnnealingWarmupLR",
    "ExponentialLR",
    "FlatAnnealingLR",
    "FlatAnnealingWarmupLR",
    "LambdaLR",
    "LinearWarmupLR",
    "MultiStepLR",
    "MultiStepWarmupLR",
    "MultiplicativeLR",
    "OneCycleLR",
    "PolynomialLR",
    "PolynomialWarmupLR",
    "StepLR",
]


def _check_steps(total_steps: int, warmup_steps: int = 0) -> None:
    if total_steps < 1:
        raise ValueError(f"total_steps must be at least 1, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}")


def _check_fraction(pct_start: float) -> None:
    if not 0.0 <= pct_start <= 1.0:
        raise ValueError(f"pct_start must be in [0, 1], got {pct_start}")


def _base_rates(optimizer: Optimizer, last_epoch: int) -> list[float]:
    key = "initial_lr" if last_epoch != -1 else "lr"
    return [float(group.get(key, group["lr"])) for group in optimizer.param_groups]


class _CurveLR(torch_schedulers.LambdaLR):
    """A `LambdaLR` whose factor per group is a `Curve` built from that group's base rate."""

    def __init__(
        self, optimizer: Optimizer, make: Callable[[float], Callable[[int], float]], last_epoch: int = -1
    ) -> None:
        curves = [make(base) for base in _base_rates(optimizer, last_epoch)]
        super().__init__(optimizer, curves, last_epoch=last_epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the schedule is (plain data, storable as JSON); the curves come from the constructor's arguments,
        as torch does for function lambdas, so a resumed scheduler is built the same way and then loaded."""
        state = super().state_dict()
        state["lr_lambdas"] = [None] * len(self.lr_lambdas)
        return state


def _warmup(steps: int) -> Warmup | None:
    return Warmup(steps) if steps > 0 else None


def _curve(decay: Decay, warmup_steps: int = 0, flat: int = 0) -> Callable[[float], Curve]:
    return lambda base: Curve(base, decay, _warmup(warmup_steps), flat)


class CosineAnnealingLR(torch_schedulers.CosineAnnealingLR):
    """torch's cosine annealing over `total_steps` down to `eta_min`."""

    def __init__(
        self, optimizer: Optimizer, total_steps: int, eta_min: float = 0.0, last_epoch: int = -1, **kwargs: Any
    ) -> None:
        _check_steps(total_steps)
        super().__init__(optimizer, total_steps, eta_min=eta_min, last_epoch=last_epoch)


class CosineAnnealingWarmupLR(_CurveLR):
    """Linear warm-up for `warmup_steps`, then cosine annealing to `eta_min` over the remaining steps."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        eta_min: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        _check_steps(total_steps, warmup_steps)
        super().__init__(optimizer, _curve(Cosine(total_steps - warmup_steps, eta_min), warmup_steps), last_epoch)


class FlatAnnealingLR(_CurveLR):
    """The base rate for `pct_start` of the steps, then cosine annealing to zero."""

    def __init__(
        self, optimizer: Optimizer, total_steps: int, pct_start: float = 0.72, last_epoch: int = -1, **kwargs: Any
    ) -> None:
        _check_steps(total_steps)
        _check_fraction(pct_start)
        flat = int(total_steps * pct_start)
        super().__init__(optimizer, _curve(Cosine(total_steps - flat, 0.0), flat=flat), last_epoch)


class FlatAnnealingWarmupLR(_CurveLR):
    """Linear warm-up, then the base rate for `pct_start` of the rest, then cosine annealing to `eta_min`."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        pct_start: float = 0.72,
        eta_min: float = 0.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        _check_steps(total_steps, warmup_steps)
        _check_fraction(pct_start)
        flat = int((total_steps - warmup_steps) * pct_start)
        decay = Cosine(total_steps - warmup_steps - flat, eta_min)
        super().__init__(optimizer, _curve(decay, warmup_steps, flat), last_epoch)


class LinearWarmupLR(_CurveLR):
    """Linear warm-up, then linear decay to zero at `total_steps`."""

    def __init__(
        self, optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, last_epoch: int = -1, **kwargs: Any
    ) -> None:
        _check_steps(total_steps, warmup_steps)
        if warmup_steps == total_steps:
            raise ValueError("LinearWarmupLR needs warmup_steps < total_steps (there would be no decay)")
        super().__init__(optimizer, lambda _base: LinearWarmupDecay(total_steps, warmup_steps), last_epoch)


class MultiStepLR(torch_schedulers.MultiStepLR):
    """torch's multi-step decay by `gamma` at each milestone."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        milestones: Sequence[int] | None = None,
        gamma: float = 0.1,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        if not milestones:
            raise ValueError("MultiStepLR needs milestones (a non-empty list of steps)")
        super().__init__(optimizer, list(milestones), gamma=gamma, last_epoch=last_epoch)


class MultiStepWarmupLR(_CurveLR):
    """Linear warm-up, then decay by `gamma` at each milestone (counted from the start of training)."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        milestones: Sequence[int] | None = None,
        gamma: float = 0.1,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        _check_steps(total_steps, warmup_steps)
        if not milestones:
            raise ValueError("MultiStepWarmupLR needs milestones (a non-empty list of steps)")
        shifted = tuple(m - warmup_steps for m in milestones if m >= warmup_steps)
        super().__init__(optimizer, _curve(Steps(shifted, gamma), warmup_steps), last_epoch)


class OneCycleLR(torch_schedulers.OneCycleLR):
    """torch's 1cycle policy with each group's current rate as its maximum, over `total_steps`."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        cycle_momentum: bool = True,
        base_momentum: float = 0.85,
        max_momentum: float = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 10000.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        _check_steps(total_steps)
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
        super().__init__(
            optimizer,
            [float(group["lr"]) for group in optimizer.param_groups],
            total_steps=total_steps,
            pct_start=pct_start,
            anneal_strategy="cos" if anneal_strategy == "cos" else "linear",
            cycle_momentum=cycle_momentum,
            base_momentum=base_momentum,
            max_momentum=max_momentum,
            div_factor=div_factor,
            final_div_factor=final_div_factor,
            last_epoch=last_epoch,
        )


class PolynomialLR(_CurveLR):
    """From the base rate to `end_lr` as (1 - s / total_steps) ** power."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        end_lr: float = 0.0001,
        power: float = 1.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        _check_steps(total_steps)
        if end_lr < 0:
            raise ValueError(f"end_lr must be >= 0, got {end_lr}")
        super().__init__(optimizer, _curve(Polynomial(total_steps, end_lr, power)), last_epoch)


class PolynomialWarmupLR(_CurveLR):
    """Linear warm-up, then polynomial decay to `end_lr` over the remaining steps."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        end_lr: float = 0.0001,
        power: float = 1.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        _check_steps(total_steps, warmup_steps)
        if end_lr < 0:
            raise ValueError(f"end_lr must be >= 0, got {end_lr}")
        decay = Polynomial(total_steps - warmup_steps, end_lr, power)
        super().__init__(optimizer, _curve(decay, warmup_steps), last_epoch)


class LambdaLR(torch_schedulers.LambdaLR):
    """torch's LambdaLR; `total_steps` is accepted for ColossalAI's signature."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        lr_lambda: Callable[[int], float] | list[Callable[[int], float]] | None = None,
        last_epoch: int = -1,
    ) -> None:
        if lr_lambda is None:
            raise ValueError("LambdaLR needs lr_lambda")
        super().__init__(optimizer, lr_lambda, last_epoch=last_epoch)


class MultiplicativeLR(torch_schedulers.MultiplicativeLR):
    """torch's MultiplicativeLR; `total_steps` is accepted for ColossalAI's signature."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        lr_lambda: Callable[[int], float] | list[Callable[[int], float]] | None = None,
        last_epoch: int = -1,
    ) -> None:
        if lr_lambda is None:
            raise ValueError("MultiplicativeLR needs lr_lambda")
        super().__init__(optimizer, lr_lambda, last_epoch=last_epoch)


class StepLR(torch_schedulers.StepLR):
    """torch's StepLR; `total_steps` is accepted for ColossalAI's signature."""

    def __init__(
        self, optimizer: Optimizer, total_steps: int, step_size: int = 1, gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        super().__init__(optimizer, step_size, gamma=gamma, last_epoch=last_epoch)


class ExponentialLR(torch_schedulers.ExponentialLR):
    """torch's ExponentialLR; `total_steps` is accepted for ColossalAI's signature."""

    def __init__(self, optimizer: Optimizer, total_steps: int, gamma: float = 1.0, last_epoch: int = -1) -> None:
        super().__init__(optimizer, gamma, last_epoch=last_epoch)
