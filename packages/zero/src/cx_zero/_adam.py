"""`CPUAdam` / `HybridAdam`: Adam and AdamW that are fast on CPU-resident (offloaded) shards and work on any device.

The step runs torch's fused multi-tensor Adam kernels (`torch._fused_adam_` / `torch._fused_adamw_`: one pass over
memory per tensor, vectorised and parallel on CPU, a single kernel on CUDA) grouped by device and dtype, so an
offloaded fp32 shard does not make the step crawl the way torch's default per-tensor CPU path does. Results equal
`torch.optim.AdamW` (or `Adam` with `adamw_mode=False`) within fp32 rounding. State uses torch's names (`step`,
`exp_avg`, `exp_avg_sq`), so state dicts interchange with torch's optimizers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["CPUAdam", "HybridAdam"]


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW (ColossalAI's arguments) on fused torch kernels; `adamw_mode=True` decouples weight decay.

    `bias_correction=False` runs an equivalent `_foreach` path (the fused kernels always correct the bias).
    NVMe offload is not implemented: a non-zero `nvme_offload_fraction` raises.
    """

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | None = None,
        **defaults: Any,
    ) -> None:
        if nvme_offload_fraction != 0.0 or nvme_offload_dir is not None:
            raise NotImplementedError(
                f"{type(self).__name__}: NVMe offload (nvme_offload_fraction={nvme_offload_fraction}, "
                f"nvme_offload_dir={nvme_offload_dir!r}) is not implemented in cx; keep the defaults (0.0, None)"
            )
        if defaults:
            raise TypeError(f"{type(self).__name__}: unsupported arguments {sorted(defaults)}")
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if not eps >= 0.0:
            raise ValueError(f"invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        super().__init__(
            model_params,
            {
                "lr": lr,
                "bias_correction": bias_correction,
                "betas": betas,
                "eps": eps,
                "weight_decay": weight_decay,
                "adamw_mode": adamw_mode,
            },
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                if param.grad.dtype != param.dtype or param.grad.device != param.device:
                    raise RuntimeError(
                        f"{type(self).__name__}: a gradient's dtype/device ({param.grad.dtype}, {param.grad.device}) "
                        f"differs from its parameter's ({param.dtype}, {param.device})"
                    )
                by_kind.setdefault((param.device, param.dtype), []).append(param)
            for params in by_kind.values():
                self._step_tensors(group, params)
        return loss

    def _state_of(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _step_tensors(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        states = [self._state_of(p) for p in params]
        grads = [p.grad for p in params if p.grad is not None]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        # The step counter lives on the parameter's device, as torch's fused path expects.
        steps = [s if s.device == p.device else s.to(p.device) for s, p in zip(steps, params, strict=True)]
        for state, step in zip(states, steps, strict=True):
            state["step"] = step
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        torch._foreach_add_(steps, 1)
        if group["bias_correction"]:
            fused = torch._fused_adamw_ if group["adamw_mode"] else torch._fused_adam_
            fused(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                steps,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                eps=eps,
                amsgrad=False,
                maximize=False,
            )
            return
        _foreach_adam_without_bias_correction(
            params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, group["adamw_mode"]
        )


def _foreach_adam_without_bias_correction(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
) -> None:
    """Adam(W) without bias correction on `_foreach` kernels."""
    if weight_decay != 0.0:
        if adamw_mode:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        else:
            grads = list(torch._foreach_add(grads, params, alpha=weight_decay))
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    denominators = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denominators, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denominators, value=-lr)


class HybridAdam(CPUAdam):
    """ColossalAI's `HybridAdam`: the same fused Adam(W) for parameters on the host and on the accelerator alike."""
