"""`FusedAdam`: ColossalAI's name and argument order for Adam(W) on fused kernels (the GPU-only optimizer scripts
import beside HybridAdam). The step is `CPUAdam`'s, which uses torch's fused kernels on every device."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from cx_zero._adam import CPUAdam

__all__ = ["FusedAdam"]


class FusedAdam(CPUAdam):
    """Adam/AdamW with ColossalAI's `FusedAdam` arguments (`adamw_mode` before `weight_decay`).

    `set_grad_none` is accepted (torch's `zero_grad` already sets gradients to None); `amsgrad=True` raises, as the
    fused kernels cx uses do not implement it here.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adamw_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise NotImplementedError("FusedAdam(amsgrad=True) is not supported in cx (nor by ColossalAI's kernel)")
        self.set_grad_none = set_grad_none
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
        )

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Gradients to None (or zeros with `set_grad_none=False`), as ColossalAI's FusedAdam does."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
