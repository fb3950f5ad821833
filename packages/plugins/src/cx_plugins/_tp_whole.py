"""`TensorParallelWholeStep`: HybridParallelPlugin (zero_stage 0) steps a matrix-wise optimizer (torch's Muon) on
whole matrices although tensor parallelism holds them as row or column slices.

Each tp-split parameter gets one owner rank in the tp group, balanced by Newton-Schulz cost (cx_zero's
`assign_owners`); the owner keeps its whole fp32 master, where the optimizer's state (Muon's momentum) lives, and
the other ranks' param groups hold a zero-stride placeholder of the whole shape with no gradient (torch's optimizers
skip it). A step: the data-parallel-averaged, unscaled, clipped gradient slices are all-gathered along the split
dimension (`unshard_tensor`, fused q/k/v parts and vocabulary padding as the checkpoint gathers them); the owner
steps its whole masters; each owner broadcasts its updated matrices over the tp group and every rank keeps its own
slice (`shard_tensor`) as its master. Replicated parameters (norms, unsplit matrices) are stepped whole by every tp
rank as before, identically. A parameter without a gradient (unused by the batch, so on every tp rank) is skipped.
The masters and the optimizer state stay where the plugin keeps them (the CPU under ZeRO's cpu_offload); only the
collectives' buffers go to the group's communication device.
Checkpoints see each rank's slice of the owner's state (`local_states`), exactly the layout an elementwise optimizer
has, and a load rebuilds the whole state on the owner (`whole_states`). At zero_stage 1/2 `_tp_zero_whole` uses the
same class on the tp slices ZeRO gathered whole onto this rank (its dp-whole masters stand for the master slices), as
GeminiPlugin does (`gemini._tp_whole`) on the tp slices Gemini gathered whole from its chunks; hence a shared module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cx_mesh import ProcessGroup, communication_device
from cx_shardformer import ShardSpec, shard_tensor, unshard_tensor
from cx_zero import assign_owners, broadcast_state

__all__ = ["TensorParallelWholeStep"]


class TensorParallelWholeStep:
    """Whole masters of the tp-split parameters on their owners; the gather / step / broadcast around a step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        sliced: Sequence[tuple[torch.Tensor, ShardSpec]],
        group: ProcessGroup | None,
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.device = communication_device(group)  # the collectives' (masters may live on the CPU: cpu_offload)
        self.sliced = list(sliced)  # (this rank's master slice, its spec), in optimizer order
        full_shapes = [spec.full_shape(master.shape) for master, spec in self.sliced]
        self.owners = assign_owners(full_shapes, dist.get_world_size(group))
        self.whole: list[torch.Tensor] = []
        for (master, spec), owner, shape in zip(self.sliced, self.owners, full_shapes, strict=True):
            full = unshard_tensor(master.to(self.device), spec, group)  # collective: every rank takes part
            if owner == self.rank:
                self.whole.append(full.to(device=master.device, dtype=master.dtype).clone())
            else:  # no memory: the optimizer sees the shape and skips it (no gradient)
                self.whole.append(torch.zeros((), dtype=master.dtype, device=master.device).expand(shape))
        whole_of = {id(master): whole for (master, _), whole in zip(self.sliced, self.whole, strict=True)}
        for param_group in optimizer.param_groups:
            param_group["params"] = [whole_of.get(id(p), p) for p in param_group["params"]]

    def gather_grads(self) -> None:
        """Each owner's whole masters get the whole gradient (all-gathered from the slices' gradients)."""
        for (master, spec), owner, whole in zip(self.sliced, self.owners, self.whole, strict=True):
            if master.grad is None:
                continue
            full = unshard_tensor(master.grad.to(self.device), spec, self.group)
            if owner == self.rank:
                whole.grad = full.to(device=whole.device, dtype=whole.dtype)

    def scatter_masters(self) -> None:
        """Every rank's master slices from their owners' updated whole masters (one broadcast per matrix)."""
        with torch.no_grad():
            for (master, spec), owner, whole in zip(self.sliced, self.owners, self.whole, strict=True):
                if master.grad is None:
                    continue
                mine = owner == self.rank
                full = whole.detach() if mine else torch.empty(whole.shape, dtype=whole.dtype, device=self.device)
                full = full.to(self.device).contiguous()
                dist.broadcast(full, group=self.group, group_src=owner)
                master.copy_(shard_tensor(full, spec, self.group))
                whole.grad = None

    # ---- state: each rank's slice of the owner's whole state, so checkpoints look like the elementwise case ----
    def master_of_whole(self) -> dict[int, torch.Tensor]:
        """id(whole master or placeholder in the param groups) -> this rank's master slice."""
        return {id(whole): master for (master, _), whole in zip(self.sliced, self.whole, strict=True)}

    def refresh_wholes(self) -> None:
        """After the master slices changed (a model or optimizer load): the owners' whole masters gathered again
        from them (collective over tp)."""
        with torch.no_grad():
            for (master, spec), owner, whole in zip(self.sliced, self.owners, self.whole, strict=True):
                full = unshard_tensor(master.to(self.device), spec, self.group)
                if owner == self.rank:
                    whole.copy_(full)

    def local_states(self, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
        """id(master slice) -> this rank's slice of its owner's state (entries shaped like the whole matrix are cut
        as the parameter is; collective over tp, one broadcast per entry)."""
        result: dict[int, dict[str, Any]] = {}
        for (master, spec), owner, whole in zip(self.sliced, self.owners, self.whole, strict=True):
            mine = dict(optimizer.state.get(whole, {})) if owner == self.rank else None
            full = broadcast_state(mine, self.group, owner)
            result[id(master)] = {
                k: shard_tensor(v.to(master.device), spec, self.group).clone()
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == whole.shape
                else v
                for k, v in full.items()
            }
        return result

    def whole_states(self, local: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
        """id(whole master) -> its whole state rebuilt on the owner from every rank's slice in `local` (by id of
        the master slice; the same entries on every tp rank, as one checkpoint gives them). Collective over tp."""
        result: dict[int, dict[str, Any]] = {}
        for (master, spec), owner, whole in zip(self.sliced, self.owners, self.whole, strict=True):
            entry = dict(local.get(id(master), {}))
            full: dict[str, Any] = {}
            for key in sorted(entry):
                value = entry[key]
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == master.shape:
                    value = unshard_tensor(value.to(self.device), spec, self.group).to(master.device)
                full[key] = value
            if owner == self.rank and full:
                result[id(whole)] = full
        return result
