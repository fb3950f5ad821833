"""What a hybrid plugin remembers of each boost for its checkpoint IO: each boosted optimizer's model and by-name
face, each model's own dtype, held weakly (an entry lives while the user holds what boost returned)."""

from __future__ import annotations

import weakref
from typing import cast

import torch
from torch import nn
from torch.optim import Optimizer

from cx_plugins._weak_lookup import WeakLookup
from cx_plugins.checkpoint_io._parallel_view import ParallelModelView
from cx_plugins.hybrid._checkpoint_io import HybridCheckpointIO
from cx_plugins.hybrid._model import HybridParallelModule
from cx_plugins.hybrid._optimizer import HybridParallelOptimizer, HybridZeroOptimizer

__all__ = ["BoostedParts", "HybridOptimizer"]

HybridOptimizer = HybridParallelOptimizer | HybridZeroOptimizer


class BoostedParts:
    """The boosted models and optimizers of one plugin, and the `HybridCheckpointIO` that reads them."""

    def __init__(self) -> None:
        self._module_of: WeakLookup[Optimizer, HybridParallelModule] = WeakLookup()
        self._wrapper_of: WeakLookup[Optimizer, HybridOptimizer] = WeakLookup()
        self._dtype_of: weakref.WeakKeyDictionary[nn.Module, torch.dtype] = weakref.WeakKeyDictionary()

    def remember(self, optimizer: Optimizer, module: HybridParallelModule, wrapped: HybridOptimizer) -> None:
        self._module_of[optimizer] = module
        self._wrapper_of[optimizer] = wrapped
        if isinstance(wrapped, HybridZeroOptimizer):  # overlap_allgather: reads wait for the step's gathers
            module.settle_on_read(wrapped.zero.synchronize_working_params)

    def remember_dtype(self, module: HybridParallelModule, dtype: torch.dtype) -> None:
        """The dtype the user's model had before the mixed-precision cast (what its checkpoints hold)."""
        self._dtype_of[module] = dtype

    def checkpoint_io(self) -> HybridCheckpointIO:
        return HybridCheckpointIO(self._parts_of, after_model_load=self._refresh_masters, model_dtype=self._saved_dtype)

    def _refresh_masters(self, view: ParallelModelView) -> None:
        for optimizer, module in self._module_of.items():
            wrapped = self._wrapper_of.get(optimizer)
            if module is view and wrapped is not None:
                wrapped.update_master_params(module)

    def _parts_of(self, optimizer: Optimizer) -> tuple[HybridParallelModule, HybridOptimizer] | None:
        """The boosted model and optimizer wrapper built around `optimizer`, while the user holds them."""
        module, wrapped = self._module_of.get(optimizer), self._wrapper_of.get(optimizer)
        return None if module is None or wrapped is None else (module, wrapped)

    def _saved_dtype(self, view: ParallelModelView) -> torch.dtype | None:
        return self._dtype_of.get(cast(nn.Module, view))
