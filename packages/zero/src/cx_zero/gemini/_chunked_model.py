"""`ChunkedModel`: what the state-dict helpers (`_state`) read of a `GeminiDDP`.

A leaf module, so that `_state` names the model it works on without importing `_ddp` (which imports `_state`):
no import cycle, not even one hidden under `TYPE_CHECKING`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from cx_chunk import ChunkManager
from cx_mesh import ProcessGroup

__all__ = ["ChunkedModel"]


class ChunkedModel(Protocol):
    """A wrapped model whose parameters live in the chunks of `manager` (`GeminiDDP` is the one there is)."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def manager(self) -> ChunkManager: ...

    @property
    def zero_group(self) -> ProcessGroup | None: ...

    @property
    def extra_dp_group(self) -> ProcessGroup | None: ...

    @property
    def all_param_names(self) -> dict[int, list[str]]: ...

    @property
    def original_dtypes(self) -> dict[int, torch.dtype]: ...

    @property
    def buffer_dtypes(self) -> dict[int, torch.dtype]: ...

    def _named_full_tensors(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]: ...
