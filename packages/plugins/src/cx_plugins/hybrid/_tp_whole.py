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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from cx_mesh import ProcessGroup
from cx_shardformer import ShardSpec, shard_tensor, unshard_tensor
from cx_zero import assign_owners

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
        self.sliced = list(sliced)  # (this rank's master slice, its spec), in optimizer order
        full_shapes = [spec.full_shape(master.shape) for master, spec in self.sliced]
        self.owners = assign_owners(full_shapes, dist.get_world_size(group))
        self.whole: list[torch.Tensor] = []
        for (master, spec), owner, shape in zip(self.sliced, self.owners, full_shapes, strict=True):
            full = unshard_tensor(master, spec, group)  # collective: every rank takes part
            if owner == self.rank:
                self.whole.append(full.to(master.dtype).clone())
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
            full = unshard_tensor(master.grad, spec, self.group)
            if owner == self.rank:
                whole.grad = full.to(whole.dtype)

    def scatter_masters(self) -> None:
        """Every rank's master slices from their owners' updated whole masters (one broadcast per matrix)."""
        with torch.no_grad():
            for (master, spec), owner, whole in zip(self.sliced, self.owners, self.whole, strict=True):
                if master.grad is None:
                    continue
                full = whole.detach() if owner == self.rank else torch.empty(whole.shape, dtype=whole.dtype)
                full = full.to(master.device).contiguous()
                dist.broadcast(full, group=self.group, group_src=owner)
                master.copy_(shard_tensor(full, spec, self.group))
                whole.grad = None
