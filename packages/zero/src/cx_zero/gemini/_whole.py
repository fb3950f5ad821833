"""`GeminiWholeStep`: Gemini around an optimizer whose update needs each parameter whole (torch's Muon).

Gemini leaves each rank a flat slice of every chunk, so a parameter's elements may lie in one or several ranks'
slices. As for LowLevelZero (`cx_zero._whole_step`, whose owner assignment and gather / scatter this reuses), each
parameter gets one owner rank in its chunk's group, balanced by Newton-Schulz cost (`_owners`), and one step is:
1. gather: every rank sends the owners its parts of their parameters' master and reduced gradient (unscaled and
   clipped, as for any optimizer), one `gather` per owner; the owner's whole master is rebuilt from the gathered
   master each step, so a loaded model or optimizer needs no separate synchronisation (the cost: the master
   travels too, twice the gradient's elements on this leg);
2. step: each owner steps the wrapped optimizer on its whole masters, whose state (Muon's momentum) lives whole
   with them; the other ranks hold a zero-stride placeholder with no gradient, which torch's optimizers skip;
3. scatter: each owner sends every rank its part of the updated parameters (one `scatter` per owner), written into
   that rank's master slice, from which `GeminiOptimizer` refreshes the parameter chunks as usual.
A keep_gathered chunk (or a group of one) holds its parameters whole on every rank: each rank steps them itself.
With tensor parallelism these whole masters are tp slices; the caller (GeminiPlugin, which knows the slicing) then
composes a second gather over tp in the wrapped optimizer's step hooks and tells the state dicts where that state
lives (`SplitWholeStates`, attached as `split`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cx_chunk import Chunk
from cx_zero._owners import assign_owners
from cx_zero._whole_comm import gather_to_owner, scatter_from_owner
from cx_zero.gemini._shards import ShardEntry

__all__ = ["GeminiWholeStep", "SplitWholeStates", "WholeParam"]


@dataclass(eq=False)
class WholeParam:
    """One parameter as the wrapped optimizer sees it: its whole master (owner) or a placeholder (others)."""

    entry: ShardEntry
    tensor: torch.Tensor
    owner: int  # group rank of the chunk's group
    spans: list[tuple[int, int]]  # per group rank: its flat range of the parameter
    local: bool  # keep_gathered chunk or one-rank group: every rank holds and steps the parameter whole

    @property
    def mine(self) -> bool:
        return self.local or self.owner == self.entry.chunk.rank


def _spans(chunk: Chunk, begin: int, end: int) -> list[tuple[int, int]]:
    """Flat ranges of the parameter at chunk elements [begin, end) in each rank's own slice."""
    size, numel = chunk.shard_size, end - begin
    return [
        (min(max(r * size - begin, 0), numel), min(max((r + 1) * size - begin, 0), numel))
        for r in range(chunk.group_size)
    ]


class SplitWholeStates(Protocol):
    """A second split of some whole masters (tp slices stepped whole on a tp owner): their optimizer state lives
    there, and the state dicts see each rank's slice of it, the layout an elementwise optimizer has."""

    @property
    def covers(self) -> Collection[int]:
        """id() of the whole masters (`WholeParam.tensor`) whose state the split holds."""
        ...

    def local_states(self) -> dict[int, dict[str, Any]]:
        """id(whole master) -> this rank's slice of its state; collective over the split's group."""
        ...

    def load_states(self, local: Mapping[int, Mapping[str, Any]]) -> None:
        """Take slice states by id(whole master) (every rank of the split's group the same keys) and rebuild them
        where the split keeps them; collective over the split's group."""
        ...


class GeminiWholeStep:
    """The whole-parameter masters of a `GeminiOptimizer`, their owners and one step's gather / step / scatter."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        entries: Sequence[ShardEntry],
        device_of: Callable[[Chunk], torch.device],
    ) -> None:
        self.params: dict[int, WholeParam] = {}  # id(entry.holder) -> its whole parameter
        self.split: SplitWholeStates | None = None  # set by `GeminiOptimizer(tp_whole=...)` under tp
        self.groups: list[list[WholeParam]] = []  # sharded parameters by chunk group, in entry order
        by_group: dict[int, list[ShardEntry]] = {}
        for entry in entries:
            chunk = entry.chunk
            if chunk.keep_gathered or chunk.group_size == 1:
                shape = chunk.slot(entry.param).shape
                tensor = torch.zeros(shape, dtype=entry.holder.dtype, device=device_of(chunk))
                self.params[id(entry.holder)] = WholeParam(entry, tensor, 0, [], True)
            else:
                by_group.setdefault(id(chunk.group), []).append(entry)
        for members in by_group.values():
            shapes = [e.chunk.slot(e.param).shape for e in members]
            owners = assign_owners(shapes, members[0].chunk.group_size)
            group = []
            for entry, shape, owner in zip(members, shapes, owners, strict=True):
                chunk = entry.chunk
                slot = chunk.slot(entry.param)
                device, dtype = device_of(chunk), entry.holder.dtype
                if owner == chunk.rank:
                    tensor = torch.zeros(shape, dtype=dtype, device=device)
                else:  # no memory: the optimizer sees the shape and skips it (its gradient stays None)
                    tensor = torch.zeros((), dtype=dtype, device=device).expand(shape)
                whole = WholeParam(entry, tensor, owner, _spans(chunk, slot.begin, slot.end), False)
                self.params[id(entry.holder)] = whole
                group.append(whole)
            self.groups.append(group)
        for param_group in optimizer.param_groups:
            param_group["params"] = [self.params[id(h)].tensor for h in param_group["params"]]

    def of(self, entry: ShardEntry) -> WholeParam:
        return self.params[id(entry.holder)]

    def step(self, optimizer: torch.optim.Optimizer, grads: Sequence[tuple[ShardEntry, torch.Tensor]]) -> None:
        """Step the parameters with a gradient: `grads` holds this rank's part of each (every rank the same
        parameters); the placeholders (`entry.holder`) view this rank's master slices, which get the result."""
        grad_of = {id(entry.holder): grad for entry, grad in grads}
        used = [w for w in self.params.values() if w.local and id(w.entry.holder) in grad_of]
        with torch.no_grad():
            for w in used:
                w.tensor.copy_(w.entry.holder.data.view(w.tensor.shape))
                w.tensor.grad = grad_of[id(w.entry.holder)].view(w.tensor.shape).to(w.tensor.dtype)
            sharded = [[w for w in group if id(w.entry.holder) in grad_of] for group in self.groups]
            for group in sharded:
                self._gather(group, grad_of)
        try:
            optimizer.step()
        finally:
            for w in self.params.values():
                w.tensor.grad = None
        with torch.no_grad():
            for w in used:
                w.entry.holder.data.copy_(w.tensor.reshape(-1))
            for group in sharded:
                self._scatter(group)

    @staticmethod
    def _by_owner(members: Sequence[WholeParam]) -> list[tuple[int, list[WholeParam]]]:
        if not members:
            return []
        size = members[0].entry.chunk.group_size
        owned = [(owner, [w for w in members if w.owner == owner]) for owner in range(size)]
        return [(owner, ws) for owner, ws in owned if ws]

    def _gather(self, members: Sequence[WholeParam], grad_of: dict[int, torch.Tensor]) -> None:
        for owner, owned in self._by_owner(members):
            chunk = owned[0].entry.chunk
            spans = [w.spans for w in owned for _ in range(2)]  # master, gradient
            local = [t for w in owned for t in (w.entry.holder.data, grad_of[id(w.entry.holder)])]
            wholes = gather_to_owner(chunk.group, owner, chunk.rank, spans, local, owned[0].tensor.dtype)
            if wholes is None:
                continue
            for index, w in enumerate(owned):
                master, grad = wholes[2 * index], wholes[2 * index + 1]
                w.tensor.copy_(master.view(w.tensor.shape))
                w.tensor.grad = grad.view(w.tensor.shape).to(w.tensor.device)

    def _scatter(self, members: Sequence[WholeParam]) -> None:
        for owner, owned in self._by_owner(members):
            chunk = owned[0].entry.chunk
            wholes = [w.tensor.detach() for w in owned] if owner == chunk.rank else None
            spans = [w.spans for w in owned]
            pieces = scatter_from_owner(chunk.group, owner, chunk.rank, spans, wholes, owned[0].tensor.dtype)
            for w, piece in zip(owned, pieces, strict=True):
                w.entry.holder.data.copy_(piece)
