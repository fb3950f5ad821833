"""cx-zero's MuonWithAdamW on FSDP2 shards: its Muon groups as `ShardedMuon` steps torch's Muon, its AdamW groups on
the shards.

`MuonWithAdamW.step` runs unchanged (its closure, hooks, lazy state, both kinds of group); only the two functions its
Muon groups step with (its public `matrix_update` / `stack_update`) are replaced on the optimizer for the duration of
the step:
- 2-D matrices: torch's Muon function becomes `ShardedMuon._muon`: momentum and weight decay on each rank's rows,
  Newton-Schulz on the whole matrix at its owner;
- 3-D stacks (fused experts, (experts, out, in)): FSDP2 shards them on dim 0, so each rank holds whole experts and
  cx-zero's `muon_stacks` runs as is on the local rows (each expert's matrix orthogonalised on its own; the lr is
  adjusted from one expert's shape either way); a rank with no experts of a stack skips it.
The AdamW groups need nothing: AdamW is elementwise, so torch's AdamW function steps the DTensor shards as it does
under torch's AdamW (`exp_avg`, `exp_avg_sq` sharded like the parameter, `step` a plain scalar). So states and
hyperparameters are MuonWithAdamW's own, and checkpoints are those of any FSDP optimizer. Not thread-safe, as
`ShardedMuon`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from cx_plugins.fsdp._muon import ShardedMuon, torch_muon_parts
from cx_zero import MuonUpdate, MuonWithAdamW

__all__ = ["ShardedMuonWithAdamW", "muon_adamw_supported"]


def muon_adamw_supported(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is MuonWithAdamW itself (a subclass may step otherwise) and torch still has the parts
    `ShardedMuon` calls."""
    return type(optimizer) is MuonWithAdamW and torch_muon_parts()


class ShardedMuonWithAdamW(ShardedMuon):
    """`ShardedMuon` over MuonWithAdamW's `use_muon` groups, its stacks stepped on their local experts (module
    docstring)."""

    def _muon_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups if g["use_muon"] for p in g["params"]]

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """MuonWithAdamW's two Muon updates replaced by the sharded ones while the optimizer steps."""
        optimizer = self.optimizer
        assert isinstance(optimizer, MuonWithAdamW)
        matrices, stacks = optimizer.matrix_update, optimizer.stack_update
        optimizer.matrix_update = self._muon
        optimizer.stack_update = functools.partial(_local_stacks, stacks)
        try:
            yield
        finally:
            optimizer.matrix_update, optimizer.stack_update = matrices, stacks


def _local_stacks(
    stacks: MuonUpdate,
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
