"""`ParameterSource`: where the values of parameters built on the meta device come from, so that `GeminiDDP` can
take a model that was never allocated (cx-plugins' `LazyInitContext` supplies one through the Booster).

GeminiDDP lays its chunks out from the parameters' shapes alone, then asks the source for the values: each full
parameter arrives once, is copied into this rank's part of its chunk (and master chunk), and is dropped by the
source afterwards, so no rank ever holds the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["ParameterSource"]


@runtime_checkable
class ParameterSource(Protocol):
    """`stream(receive)` calls `receive(parameter, value)` exactly once for every parameter of the module that is on
    the meta device, one at a time and in any order; `value` is the full tensor (the parameter's shape, any
    floating dtype, any device), valid only during the call. Before returning it also gives the module's meta
    buffers their real values (GeminiDDP then places them as it places any buffer)."""

    def stream(self, receive: Callable[[nn.Parameter, torch.Tensor], None]) -> None: ...
