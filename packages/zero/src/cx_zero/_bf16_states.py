"""Adam's moments kept in bf16 between steps (torchtitan's `fused_opt_states_bf16`), halving their memory.

Each step upcasts one parameter's `exp_avg` / `exp_avg_sq` to fp32, applies Adam(W) in fp32 exactly as torch does,
and stores the moments back in bf16 with stochastic rounding: uniform random bits are added below bf16's mantissa
(the low 16 bits of the fp32 pattern) before truncating, so each moment rounds up with probability equal to the
discarded fraction and the rounding error averages out over steps instead of biasing the moments towards zero (a
moment that changes by less than half a bf16 ulp per step would never move under round-to-nearest).

The random bits are a pure function of (seed, step, the parameter's salt), so a run is reproducible and a resumed
run draws the same bits as the uninterrupted one without any generator state in the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from cx_zero._adam import CPUAdam

__all__ = ["BF16_STATE_OPTIMIZERS", "MOMENT_KEYS", "Bf16StateAdam", "require_bf16_capable", "stochastic_round_bf16"]

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
BF16_STATE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW, CPUAdam)
_LOW_BITS = 1 << 16  # the fp32 mantissa bits that bf16 drops
_MASK = ~(_LOW_BITS - 1)  # as int32: 0xFFFF0000
_SEED_MODULUS = (1 << 63) - 1


def stochastic_round_bf16(value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`value` (fp32) in bf16, rounded up in magnitude with probability equal to the dropped fraction.

    Adding to the int32 pattern adds to the magnitude bits for either sign (IEEE floats are sign-magnitude), and
    truncating then leaves an exact bf16 value. Non-finite values pass through unchanged.
    """
    if value.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 takes an fp32 tensor, got {value.dtype}")
    bits = torch.randint(0, _LOW_BITS, value.shape, dtype=torch.int32, device=value.device, generator=generator)
    rounded = ((value.view(torch.int32) + bits) & _MASK).view(torch.float32)
    return torch.where(torch.isfinite(value), rounded, value).to(torch.bfloat16)


def _seed(seed: int, step: int, salt: int) -> int:
    return ((seed * 1_000_003 + step) * 2_147_483_647 + salt) % _SEED_MODULUS


class Bf16StateAdam:
    """Steps a torch `Adam` / `AdamW` or cx `CPUAdam` (HybridAdam, FusedAdam) with its moments in bf16.

    The state stays in `optimizer.state` under torch's keys (`step`, `exp_avg`, `exp_avg_sq`), so state dicts keep
    their layout; only the moments' dtype differs. `salts` maps id(parameter) to a number that tells parameters (and
    ranks' shards) apart in the random stream; parameters without one use their position in the param groups.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, seed: int, salts: Mapping[int, int] | None = None) -> None:
        require_bf16_capable(optimizer, "optimizer_states_dtype=bf16")
        self.optimizer = optimizer
        self.seed = seed
        self.salts = dict(salts or {})

    def step(self) -> None:
        """One update, entered through the optimizer's own `step`, so what watches that call sees a normal step (an
        LR scheduler's check that the optimizer stepped first, step pre/post hooks around the update): the closure
        torch's Adam(W) and cx's CPUAdam run before their own update does the bf16-state update and takes the
        gradients away, so their own update finds nothing to do."""
        self.optimizer.step(self._update)

    @torch.no_grad()
    def _update(self) -> float:
        position = 0
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                salt = self.salts.get(id(param), position)
                position += 1
                if param.grad is not None:
                    self._step_one(group, param, param.grad, salt)
                    param.grad = None  # stepped: the wrapped optimizer's own update must skip it
        return 0.0  # the closure's "loss" in torch's contract; there is no forward here

    def to_bf16(self) -> None:
        """Moments of another dtype (a checkpoint of fp32 states, or torch's load_state_dict casting to the
        parameter's dtype) in bf16, rounded to nearest."""
        for state in self.optimizer.state.values():
            for key in MOMENT_KEYS:
                value = state.get(key)
                if isinstance(value, torch.Tensor) and value.dtype != torch.bfloat16:
                    state[key] = value.to(torch.bfloat16)

    def _state(self, param: torch.Tensor) -> dict[str, Any]:
        state: dict[str, Any] = self.optimizer.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            for key in MOMENT_KEYS:
                state[key] = torch.zeros_like(param, dtype=torch.bfloat16, memory_format=torch.preserve_format)
        return state

    def _step_one(self, group: Mapping[str, Any], param: torch.Tensor, grad: torch.Tensor, salt: int) -> None:
        if param.dtype != torch.float32:
            raise TypeError(f"optimizer_states_dtype=bf16 steps fp32 master weights, got a {param.dtype} parameter")
        state = self._state(param)
        state["step"] += 1
        step = int(state["step"].item())
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, eps, weight_decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        grad = grad.float()
        if group.get("maximize", False):
            grad = -grad
        if weight_decay != 0.0:
            if _decoupled(self.optimizer, group):
                param.mul_(1.0 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg = state["exp_avg"].float().lerp_(grad, 1.0 - beta1)
        exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        if group.get("bias_correction", True):
            step_size = lr / (1.0 - beta1**step)
            denominator = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**step)).add_(eps)
        else:
            step_size = lr
            denominator = exp_avg_sq.sqrt().add_(eps)
        param.addcdiv_(exp_avg, denominator, value=-step_size)
        generator = torch.Generator(device=param.device).manual_seed(_seed(self.seed, step, salt))
        state["exp_avg"] = stochastic_round_bf16(exp_avg, generator)
        state["exp_avg_sq"] = stochastic_round_bf16(exp_avg_sq, generator)


def _decoupled(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> bool:
    if "adamw_mode" in group:  # CPUAdam and its subclasses
        return bool(group["adamw_mode"])
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


def require_bf16_capable(optimizer: torch.optim.Optimizer, who: str) -> None:
    """Raise unless `optimizer` is an Adam(W) whose options this stepper implements."""
    if not isinstance(optimizer, BF16_STATE_OPTIMIZERS):
        accepted = ", ".join(cls.__name__ for cls in BF16_STATE_OPTIMIZERS)
        raise TypeError(
            f"{who}: bf16 states are implemented for Adam(W) only ({accepted}), got {type(optimizer).__name__}"
        )
    for group in optimizer.param_groups:
        if group.get("amsgrad", False):
            raise ValueError(f"{who}: amsgrad keeps a third moment; it is not supported with bf16 states")
