"""`WholeTensorStep`: ZeRO around an optimizer whose update needs each parameter whole (torch's Muon).

ZeRO leaves each rank a flat slice of every parameter; Newton-Schulz on a slice is not a slice of Newton-Schulz on the
matrix. So each parameter gets one owner rank in its data-parallel group (`_owners`: balanced by Newton-Schulz cost),
and one step is:
1. gather: after ZeRO's reduction (and unscaling / clipping, which act on the slices), every rank sends its slices of
   the gradients to their owners, one `gather` per owner holding the slices of all its parameters;
2. step: each owner steps the wrapped optimizer on its whole master matrices (fp32 copies, or the parameters
   themselves in a one-replica group); the optimizer's state (Muon's momentum) lives with them, so the state is
   sharded by matrix instead of by element; the other ranks' param groups hold a zero-stride placeholder of the same
   shape with no gradient, which torch's optimizers skip;
3. scatter: each owner sends every rank its slice of the updated matrices (one `scatter` per owner), written into
   the ZeRO master shards, from which the usual all-gather rebuilds the working parameters.
Each element crosses the network once each way, as ZeRO-1's own step would: the gathered gradient in the master
dtype, the updated slice back. A parameter no rank used this step is skipped (its gradient is None), as torch skips
it; every rank agrees which (the used flags travelled with the gradient buckets).

Only the parameters given (`shards`) are stepped whole: the param groups an optimizer declares elementwise
(`cx_zero.elementwise_groups`, MuonWithAdamW's AdamW groups) keep their master shards in the optimizer and are
stepped on them in the same `optimizer.step()`, their state sharded by element as for any elementwise optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cx_mesh import ProcessGroup
from cx_zero._owners import assign_owners
from cx_zero._partition import ParamShard, padded_flat
from cx_zero._whole_comm import gather_to_owner, scatter_from_owner

__all__ = ["WholeTensorStep"]


class WholeTensorStep:
    """The whole-parameter masters, their owners and the gather / step / scatter of one optimizer step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        shards: Sequence[ParamShard],
        groups: Sequence[ProcessGroup | None],
        master_dtype: torch.dtype,
    ) -> None:
        self.groups = list(groups)
        self.master_dtype = master_dtype
        self.owner: dict[int, int] = {}  # id(shard) -> owning rank within the shard's group
        self.whole: dict[int, torch.Tensor] = {}  # id(shard) -> its whole master (owner) or a placeholder (others)
        self._by_group: list[list[ParamShard]] = [[] for _ in self.groups]
        for shard in shards:
            self._by_group[shard.group_index].append(shard)
        for members in self._by_group:
            if not members:
                continue
            owners = assign_owners([s.working.shape for s in members], members[0].group_size)
            for shard, owner in zip(members, owners, strict=True):
                self.owner[id(shard)] = owner
                self.whole[id(shard)] = self._whole_master(shard, owner)
        by_master = {id(s.master): s for s in shards}
        for group in optimizer.param_groups:  # the masters of other (elementwise) groups stay as they are
            group["params"] = [self.whole[id(by_master[id(m)])] if id(m) in by_master else m for m in group["params"]]

    def _whole_master(self, shard: ParamShard, owner: int) -> torch.Tensor:
        shape, device = shard.working.shape, shard.master.device
        if shard.group_size == 1:
            return shard.master.view(shape)  # the master shard is the whole parameter: step it in place
        if shard.group_rank == owner:
            return shard.working.detach().to(device=device, dtype=self.master_dtype).clone()
        # no memory: the optimizer sees the shape (and skips the parameter, whose gradient stays None)
        return torch.zeros((), dtype=self.master_dtype, device=device).expand(shape)

    def holds(self, shard: ParamShard) -> bool:
        """Whether `shard`'s parameter is stepped whole here (False: an elementwise group's, stepped on its shard)."""
        return id(shard) in self.owner

    def owns(self, shard: ParamShard) -> bool:
        """Whether this rank steps `shard`'s parameter whole (False for one not stepped whole here)."""
        return self.owner.get(id(shard)) == shard.group_rank

    def shard_of_param(self) -> dict[int, ParamShard]:
        """id(optimizer parameter) -> its shard (for the state dicts)."""
        return {id(self.whole[id(s)]): s for members in self._by_group for s in members}

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Gather the used parameters' gradients to their owners, step the owners' whole masters, scatter back."""
        used = [[s for s in members if s.grad_shard is not None] for members in self._by_group]
        for index, members in enumerate(used):
            self._gather_grads(self.groups[index], members)
        try:
            optimizer.step()
        finally:
            for tensor in self.whole.values():
                tensor.grad = None
        for index, members in enumerate(used):
            self._scatter_masters(self.groups[index], members)

    def _owned_by(self, members: Sequence[ParamShard], owner: int) -> list[ParamShard]:
        return [s for s in members if self.owner[id(s)] == owner]

    def _gather_grads(self, group: ProcessGroup | None, members: Sequence[ParamShard]) -> None:
        """Each owner's whole masters get the whole gradient (a view of the slice in a one-replica group)."""
        if members and members[0].group_size == 1:
            for shard in members:
                assert shard.grad_shard is not None
                self.whole[id(shard)].grad = shard.grad_shard.view(shard.working.shape)
            return
        for shard, full in self._gather_to_owners(group, members, lambda s: s.grad_shard).items():
            master = self.whole[id(shard)]
            master.grad = full.to(device=master.device, dtype=master.dtype)

    def _spans(self, members: Sequence[ParamShard]) -> list[list[tuple[int, int]]]:
        """Rank r holds elements [r * width, (r + 1) * width) of each padded flat parameter (`_partition`)."""
        return [[(r * s.shard_numel, (r + 1) * s.shard_numel) for r in range(s.group_size)] for s in members]

    def _gather_to_owners(
        self,
        group: ProcessGroup | None,
        members: Sequence[ParamShard],
        slice_of: Callable[[ParamShard], torch.Tensor | None],
    ) -> dict[ParamShard, torch.Tensor]:
        """Every rank's `slice_of` each parameter, concatenated at its owner: the whole tensors this rank owns (one
        `gather` per owner that owns any of `members`)."""
        result: dict[ParamShard, torch.Tensor] = {}
        if not members:
            return result
        size, rank = members[0].group_size, members[0].group_rank
        for owner in range(size):
            owned = self._owned_by(members, owner)
            if not owned:
                continue
            slices = [slice_of(s) for s in owned]
            local = [t for t in slices if t is not None]
            wholes = gather_to_owner(group, owner, rank, self._spans(owned), local, self.master_dtype)
            for shard, full in zip(owned, wholes or [], strict=False):
                result[shard] = full[: shard.numel].view(shard.working.shape)
        return result

    def _scatter_masters(self, group: ProcessGroup | None, members: Sequence[ParamShard]) -> None:
        if not members or members[0].group_size == 1:
            return  # a one-replica master is the whole parameter, stepped in place
        size, rank = members[0].group_size, members[0].group_rank
        for owner in range(size):
            owned = self._owned_by(members, owner)
            if not owned:
                continue
            wholes = [padded_flat(self.whole[id(s)].detach(), size) for s in owned] if rank == owner else None
            pieces = scatter_from_owner(group, owner, rank, self._spans(owned), wholes, self.master_dtype)
            with torch.no_grad():
                for shard, piece in zip(owned, pieces, strict=True):
                    shard.master.copy_(piece)

    def load_whole_masters(self) -> None:
        """After the master shards changed (a loaded model or checkpoint): each owner's whole masters gathered from
        the shards (collective over every group), so the next step starts from the loaded values."""
        with torch.no_grad():
            for index, members in enumerate(self._by_group):
                if not members or members[0].group_size == 1:
                    continue  # the whole master is the shard itself
                for shard, full in self._gather_to_owners(self.groups[index], members, lambda s: s.master).items():
                    self.whole[id(shard)].copy_(full)

    def master_bytes(self) -> int:
        """Bytes of the whole masters this rank owns (beyond its master shards)."""
        return sum(
            t.numel() * t.element_size()
            for members in self._by_group
            for s in members
            if s.group_size > 1 and self.owns(s)
            for t in [self.whole[id(s)]]
        )
