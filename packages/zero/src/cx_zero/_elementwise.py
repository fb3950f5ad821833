"""Which optimizers may step on flat shards: only those whose update of an element depends on that element alone.

ZeRO (LowLevelZero and Gemini) hands the wrapped optimizer 1-D slices of each parameter, so an optimizer that looks
at a whole matrix or a whole parameter (factored second moments, per-parameter trust ratios as in LAMB/LARS, line
search, sparse gradients) would silently compute something else. Those are refused; unknown optimizer classes are
refused too, naming the list.
"""

from __future__ import annotations

import torch

from cx_zero._adam import CPUAdam, HybridAdam

__all__ = ["ELEMENTWISE_OPTIMIZERS", "require_elementwise"]

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
    CPUAdam,
    HybridAdam,
)


def require_elementwise(optimizer: torch.optim.Optimizer, who: str) -> None:
    """Raise TypeError unless `optimizer` is (a subclass of) one of `ELEMENTWISE_OPTIMIZERS`."""
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        return
    accepted = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    raise TypeError(
        f"{who}: {type(optimizer).__name__} is not known to be elementwise (its update of one element may depend on "
        f"others, e.g. factored, per-parameter or matrix-wise updates), so it cannot step on flat parameter shards; "
        f"accepted: {accepted}"
    )
