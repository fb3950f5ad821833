"""cx-zero's MuonWithAdamW on FSDP2 shards: its Muon groups as `ShardedMuon` steps torch's Muon, its AdamW groups on
the shards.

`MuonWithAdamW.step` runs unchanged (its closure, hooks, lazy state, both kinds of group); only the two functions its
Muon groups call are replaced for the duration of the step, as `ShardedMuon` replaces torch's Muon function:
- 2-D matrices: torch's Muon function (`torch.optim._muon.muon`, held by MuonWithAdamW's module) becomes
  `ShardedMuon._muon`: momentum and weight decay on each rank's rows, Newton-Schulz on the whole matrix at its owner;
- 3-D stacks (fused experts, (experts, out, in)): FSDP2 shards them on dim 0, so each rank holds whole experts and
  cx-zero's `muon_stacks` runs as is on the local rows (each expert's matrix orthogonalised on its own; the lr is
  adjusted from one expert's shape either way); a rank with no experts of a stack skips it.
The AdamW groups need nothing: AdamW is elementwise, so torch's AdamW function steps the DTensor shards as it does
under torch's AdamW (`exp_avg`, `exp_avg_sq` sharded like the parameter, `step` a plain scalar). So states and
hyperparameters are MuonWithAdamW's own, and checkpoints are those of any FSDP optimizer.

MuonWithAdamW calls the two functions through its module's globals, so that module is found from the class (cx's
layer rule keeps other packages' private modules out of imports) and `muon_adamw_supported` checks that both are
still there as expected: if cx-zero steps otherwise, TorchFSDPPlugin refuses the optimizer instead of training
on slices. Not thread-safe, as `ShardedMuon`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.optim._muon as torch_muon
from torch.distributed.tensor import DTensor

from cx_plugins.fsdp._muon import ShardedMuon, torch_muon_parts
from cx_zero import MuonWithAdamW

__all__ = ["ShardedMuonWithAdamW", "muon_adamw_supported"]

_MATRICES, _STACKS = "_muon_update", "muon_stacks"  # the globals MuonWithAdamW's Muon groups call


def _stepping_module() -> ModuleType:
    """The module whose globals MuonWithAdamW's step calls."""
    return sys.modules[MuonWithAdamW.__module__]


def muon_adamw_supported(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is MuonWithAdamW itself (a subclass may step otherwise), calling torch's Muon function and
    `muon_stacks` through its module, and torch still has the parts `ShardedMuon` calls."""
    if type(optimizer) is not MuonWithAdamW or not torch_muon_parts():
        return False
    module = _stepping_module()
    return getattr(module, _MATRICES, None) is torch_muon.muon and callable(getattr(module, _STACKS, None))


class ShardedMuonWithAdamW(ShardedMuon):
    """`ShardedMuon` over MuonWithAdamW's `use_muon` groups, its stacks stepped on their local experts (module
    docstring)."""

    def _muon_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups if g["use_muon"] for p in g["params"]]

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """MuonWithAdamW's two Muon functions replaced by the sharded ones while the optimizer steps."""
        module = _stepping_module()
        matrices: Callable[..., None] = getattr(module, _MATRICES)
        stacks: Callable[..., None] = getattr(module, _STACKS)
        setattr(module, _MATRICES, self._muon)
        setattr(module, _STACKS, lambda *tensors, **options: _local_stacks(stacks, *tensors, **options))
        try:
            yield
        finally:
            setattr(module, _MATRICES, matrices)
            setattr(module, _STACKS, stacks)


def _local_stacks(
    stacks: Callable[..., None],
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    **options: Any,
) -> None:
    """`stacks` (cx-zero's `muon_stacks`) on each rank's whole experts: the local rows of DTensor stacks (in place on
    the shards), skipping a stack of which this rank holds no expert."""
    held: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])
    for tensors in zip(params, grads, buffers, strict=True):
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        if local[0].shape[0] > 0:
            for column, tensor in zip(held, local, strict=True):
                column.append(tensor)
    if held[0]:
        stacks(*held, **options)
