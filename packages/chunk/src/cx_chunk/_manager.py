"""`ChunkManager`: tensors registered into chunk groups, chunk operations, and exact memory accounting.

Every operation that can change what a chunk holds goes through the manager, which takes the chunk's memory usage
before and after it, so `usage` (bytes of chunk payload per device kind, current) is always the sum over all
chunks it owns: parameter chunks, their paired master chunks and gradient chunks. `peak` is the largest value each
kind has reached, including the moments inside an operation when old and new storage coexist (a gather's new
buffer while the shard exists, a shard copied out of the buffer, a reduce-scatter's output). cx-zero, the
benchmarks and the tests read these figures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from cx_chunk._chunk import Chunk
from cx_chunk._config import ChunkConfig
from cx_chunk._errors import ChunkError
from cx_chunk._layout import MemoryUsage, Residence
from cx_chunk._states import TensorState
from cx_mesh import ProcessGroup, get_accelerator, require_initialized

__all__ = ["ChunkManager"]

_T = TypeVar("_T")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class ChunkManager:
    """Owns the chunks of one data-parallel group and accounts for their memory."""

    def __init__(
        self,
        config: ChunkConfig,
        *,
        group: ProcessGroup | None = None,
        extra_dp_group: ProcessGroup | None = None,
        compute_device: torch.device | None = None,
        init_device: torch.device | None = None,
        pin_memory: bool = False,
        fp8_communication: bool = False,
    ) -> None:
        require_initialized("cx_chunk.ChunkManager")
        self.fp8_communication = fp8_communication  # gradients and master-backed gathers in fp8 (see Chunk)
        self.config = config
        self.group = group
        self.extra_dp_group = extra_dp_group
        self.compute_device = compute_device if compute_device is not None else get_accelerator().current_device()
        self.init_device = init_device  # where chunks are built (None: the compute device); see Chunk
        self.pin_memory = pin_memory
        self.group_size = dist.get_world_size(group)
        if config.chunk_size % self.group_size != 0:
            raise ValueError(
                f"ChunkManager: chunk_size {config.chunk_size} is not a multiple of the group size {self.group_size}"
            )
        self._groups: dict[str, list[Chunk]] = {}
        self._open: dict[str, Chunk | None] = {}
        self._closed_groups: set[str] = set()
        self._tensor_chunk: dict[int, Chunk] = {}
        self._masters: dict[int, Chunk] = {}
        self._grads: dict[int, Chunk] = {}
        self._states: dict[tuple[int, str], Chunk] = {}
        self._next_id = 0
        self._accessed: set[Chunk] = set()
        self._reducing: list[Chunk] = []
        self._usage = MemoryUsage()
        self._peak = MemoryUsage()
        self._collectives = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.on_collective: Callable[[str, Chunk], None] | None = None

    @property
    def usage(self) -> MemoryUsage:
        """Bytes of chunk payload resident now, per device kind (every chunk this manager owns)."""
        return self._usage

    @property
    def peak(self) -> MemoryUsage:
        """The largest `usage` of each device kind since creation or `reset_peak`, transients included."""
        return self._peak

    @property
    def collective_counts(self) -> dict[str, int]:
        """Collectives issued so far: all_gather, reduce_scatter, all_reduce."""
        return dict(self._collectives)

    def _issued(self, kind: str, chunk: Chunk) -> None:
        """Count a collective issued for `chunk` and tell `on_collective` (cx-zero's path check records the
        sequence: ranks must issue the same collectives for the same chunks in the same order)."""
        self._collectives[kind] += 1
        if self.on_collective is not None:
            self.on_collective(kind, chunk)

    @property
    def accessed(self) -> frozenset[Chunk]:
        """Chunks accessed and not yet released or marked unused (in use by the running operation)."""
        return frozenset(self._accessed)

    # ----------------------------------------------------------------------------------------- registration
    def register_tensor(self, tensor: torch.Tensor, group_name: str = "param", *, name: str | None = None) -> Chunk:
        """Append `tensor` to the group's open chunk (a new one when full; an own chunk for outliers)."""
        if group_name in self._closed_groups:
            raise ChunkError(f"chunk group {group_name!r} is closed: no tensor can be registered into it")
        if id(tensor) in self._tensor_chunk:
            raise ValueError(f"tensor {name or tuple(tensor.shape)} is already registered")
        chunks = self._groups.setdefault(group_name, [])
        if chunks and chunks[0].dtype != tensor.dtype:
            raise ValueError(
                f"chunk group {group_name!r} holds {chunks[0].dtype}; register {tensor.dtype} tensors in another group"
            )
        numel = tensor.numel()
        if self.config.gets_own_chunk(numel):
            chunk = self._new_chunk(_round_up(max(numel, 1), self.group_size), tensor.dtype)
            chunks.append(chunk)
            self._tracked_append(chunk, tensor, name)
            self._tracked(chunk, chunk.close)
            return chunk
        current = self._open.get(group_name)
        if current is None or not current.has_room(numel):
            if current is not None:
                self._tracked(current, current.close)
            current = self._new_chunk(self.config.chunk_size, tensor.dtype)
            chunks.append(current)
            self._open[group_name] = current
        self._tracked_append(current, tensor, name)
        return current

    def register_apart(
        self, tensors: Sequence[torch.Tensor], group_name: str = "param", *, names: Sequence[str] | None = None
    ) -> list[Chunk]:
        """Register tensors that are used together into closed chunks of their own (never shared with tensors
        registered otherwise): packed first-fit, largest first, into as few chunks as hold at most `chunk_size`
        elements (or the largest tensor), each sized to what it holds (rounded up to the group size), so setting
        them apart costs no padding. For tensors that stay gathered far longer than the rest (a model's embedding
        and final norm): in a shared chunk they would keep their neighbours gathered."""
        if names is not None and len(names) != len(tensors):
            raise ValueError(f"register_apart: {len(tensors)} tensors but {len(names)} names")
        if group_name in self._closed_groups:
            raise ChunkError(f"chunk group {group_name!r} is closed: no tensor can be registered into it")
        if len({id(t) for t in tensors}) != len(tensors) or any(id(t) in self._tensor_chunk for t in tensors):
            raise ValueError("register_apart: a tensor is given twice or is already registered")
        dtypes = {t.dtype for t in tensors} | {c.dtype for c in self._groups.get(group_name, [])[:1]}
        if len(dtypes) > 1:
            raise ValueError(f"register_apart: chunk group {group_name!r} would mix dtypes {sorted(map(str, dtypes))}")
        # first fit, largest first, into chunks as large as the chunk size or the largest tensor: an embedding
        # larger than a chunk still takes the small tensors that live with it (one collective, not several)
        capacity = max(self.config.chunk_size, max((t.numel() for t in tensors), default=0))
        plan: list[list[int]] = []
        filled: list[int] = []
        for index in sorted(range(len(tensors)), key=lambda i: -tensors[i].numel()):
            numel = tensors[index].numel()
            target = next((b for b, used in enumerate(filled) if used + numel <= capacity), None)
            if target is None:
                plan.append([])
                filled.append(0)
                target = len(plan) - 1
            plan[target].append(index)
            filled[target] += numel
        made = []
        for members in plan:
            size = _round_up(max(sum(tensors[i].numel() for i in members), 1), self.group_size)
            chunks = self._groups.setdefault(group_name, [])
            chunk = self._new_chunk(size, tensors[members[0]].dtype)
            chunks.append(chunk)
            for i in members:
                self._tracked_append(chunk, tensors[i], names[i] if names is not None else None)
            self._tracked(chunk, chunk.close)
            made.append(chunk)
        return made

    def close_group(self, group_name: str) -> list[Chunk]:
        """Close the group's open chunk (sharded chunks then hold only their own slice)."""
        if group_name not in self._groups:
            raise KeyError(f"no chunk group named {group_name!r}")
        chunk = self._open.pop(group_name, None)
        if chunk is not None:
            self._tracked(chunk, chunk.close)
        self._closed_groups.add(group_name)
        return list(self._groups[group_name])

    def close_all_groups(self) -> None:
        for group_name in list(self._groups):
            if group_name not in self._closed_groups:
                self.close_group(group_name)

    # ------------------------------------------------------------------------------------------------ lookup
    def get_chunk(self, tensor: torch.Tensor) -> Chunk:
        try:
            return self._tensor_chunk[id(tensor)]
        except KeyError:
            raise KeyError(f"tensor of shape {tuple(tensor.shape)} is not registered in this ChunkManager") from None

    def chunks_of(self, tensors: Iterable[torch.Tensor]) -> list[Chunk]:
        """The distinct chunks holding `tensors`, in chunk order."""
        found = {self.get_chunk(t) for t in tensors}
        return sorted(found, key=lambda c: c.chunk_id)

    def chunks(self, group_name: str | None = None) -> list[Chunk]:
        """Parameter chunks of one group (all groups when None), in creation order."""
        if group_name is not None:
            return list(self._groups[group_name])
        return [c for chunks in self._groups.values() for c in chunks]

    def all_chunks(self) -> list[Chunk]:
        """Every chunk whose memory is accounted: parameter, master and gradient chunks."""
        return [*self.chunks(), *self._masters.values(), *self._grads.values(), *self._states.values()]

    def transition(self, tensors: Iterable[torch.Tensor], state: TensorState) -> None:
        for tensor in tensors:
            self.get_chunk(tensor).transition(tensor, state)

    # ------------------------------------------------------------------------------------------- operations
    def access_chunk(self, chunk: Chunk, *, async_op: bool = False) -> None:
        """Gather `chunk` on the compute device (moving its shard there first) and mark it accessed."""
        if chunk.residence is Residence.HOST and not chunk.keep_gathered:
            self._tracked(chunk, lambda: chunk.move(Residence.DEVICE))
        if not chunk.is_gathered:
            self._note_transient(chunk, chunk.nbytes)  # the new buffer exists while the own slice still does
        if self._tracked(chunk, lambda: chunk.gather(async_op=async_op)):
            self._issued("all_gather", chunk)
        self._accessed.add(chunk)

    def prefetch_chunk(self, chunk: Chunk) -> None:
        """Start gathering `chunk` ahead of use (asynchronously where the backend allows); not marked accessed."""
        if chunk.residence is Residence.HOST and not chunk.keep_gathered:
            self._tracked(chunk, lambda: chunk.move(Residence.DEVICE))
        if not chunk.is_gathered:
            self._note_transient(chunk, chunk.nbytes)
        if self._tracked(chunk, lambda: chunk.gather(async_op=True)):
            self._issued("all_gather", chunk)

    def wait_chunk(self, chunk: Chunk) -> None:
        self._tracked(chunk, chunk.wait)

    def mark_unused(self, chunk: Chunk) -> None:
        """The current operation no longer uses `chunk` (it may now be evicted even if kept gathered)."""
        self._accessed.discard(chunk)

    def release_chunk(self, chunk: Chunk, to: Residence | None = None) -> bool:
        """Shard an accessed chunk when none of its tensors is in use; returns whether it was sharded.
        `to=Residence.HOST` puts the own slice straight on the host (eviction)."""
        self._accessed.discard(chunk)
        if chunk.keep_gathered or not chunk.can_release:
            return False
        if chunk.is_gathered and to is not Residence.HOST:
            self._note_transient(chunk, chunk.shard_nbytes)  # the own slice is copied out before the buffer goes
        return bool(self._tracked(chunk, lambda: chunk.shard(to)))

    def move_chunk(self, chunk: Chunk, residence: Residence) -> bool:
        return bool(self._tracked(chunk, lambda: chunk.move(residence)))

    def reduce_chunk(self, chunk: Chunk, *, async_op: bool = False) -> None:
        """Reduce the chunk's gradients (into its gradient chunk when it has one); needs all READY_FOR_REDUCE.
        `async_op=True` (chunks holding their gradients in the buffer) starts the reduce-scatter and leaves it to
        `finish_reductions`, so it overlaps whatever the caller computes next."""
        if not chunk.can_reduce:
            waiting = [
                f"{slot.name} ({chunk.tensor_state(t).name})"
                for t, slot in zip(chunk.tensors, chunk.slots, strict=True)
                if chunk.tensor_state(t) is not TensorState.READY_FOR_REDUCE
            ]
            raise ChunkError(f"chunk {chunk.chunk_id} is not ready for reduce: {', '.join(waiting)}")
        grad_chunk = self._grads.get(id(chunk))
        if chunk.grads_in_buffer:
            self._reduce_in_buffer(chunk, grad_chunk, async_op)
        else:
            self._reduce_separate(chunk, grad_chunk)
        self._issued("all_reduce" if chunk.keep_gathered else "reduce_scatter", chunk)
        if chunk.extra_dp_group is not None:
            self._issued("all_reduce", chunk)
        self._accessed.discard(chunk)

    def _reduce_in_buffer(self, chunk: Chunk, grad_chunk: Chunk | None, async_op: bool) -> None:
        """The gradients sit in the parameter chunk's own buffer: reduce-scatter it into the gradient chunk."""
        if grad_chunk is None:
            raise ChunkError(f"chunk {chunk.chunk_id} holds gradients in its buffer but has no gradient chunk")
        if grad_chunk.is_gathered:
            raise ChunkError(f"chunk {chunk.chunk_id}: gradients both in its buffer and in its gradient chunk's")
        if not async_op:  # the reduced slice (and the collective's scratch) exist while the buffer does
            self._note_transient(chunk, chunk.shard_nbytes + chunk.reduce_scratch_nbytes)
        with self._accounting(chunk), self._accounting(grad_chunk):
            chunk.reduce_into(grad_chunk, async_op=async_op)
        if async_op:
            self._reducing.append(chunk)

    def _reduce_separate(self, chunk: Chunk, grad_chunk: Chunk | None) -> None:
        """The gradients sit in the gradient chunk's buffer (or, without one, were written into the chunk)."""
        if grad_chunk is not None and not grad_chunk.is_gathered:
            raise ChunkError(
                f"chunk {chunk.chunk_id} has a gradient chunk but no gradient was accumulated into it since the last "
                "reduce (use accumulate_grad, not write_grad, for chunks with gradient chunks)"
            )
        target = grad_chunk if grad_chunk is not None else chunk
        if not chunk.keep_gathered:  # the reduced slice (and the collective's scratch) exist while the buffer does
            self._note_transient(target, target.shard_nbytes + target.reduce_scratch_nbytes)
        self._tracked(target, lambda: target.reduce(accumulate=target is grad_chunk))
        if target is grad_chunk:
            for tensor in chunk.tensors:
                chunk.transition(tensor, TensorState.HOLD)

    @property
    def reducing(self) -> list[Chunk]:
        """Chunks whose asynchronous reduction is in flight, oldest first."""
        return list(self._reducing)

    def finish_reductions(self) -> list[Chunk]:
        """Complete every asynchronous reduction in flight, oldest first; returns their chunks."""
        done = []
        while self._reducing:
            chunk = self._reducing.pop(0)
            with self._accounting(chunk), self._accounting(self._grads[id(chunk)]):
                chunk.finish_reduce()
            done.append(chunk)
        return done

    # ---------------------------------------------------------------------------------- master and gradients
    def create_master_chunks(
        self, group_name: str, dtype: torch.dtype = torch.float32, residence: Residence = Residence.DEVICE
    ) -> list[Chunk]:
        """A paired chunk of `dtype` (same layout, own slice copied) for every chunk of a closed group."""
        if group_name not in self._closed_groups:
            raise ChunkError(f"create_master_chunks: close chunk group {group_name!r} first")
        masters = []
        for chunk in self._groups[group_name]:
            if id(chunk) in self._masters:
                raise ChunkError(f"chunk {chunk.chunk_id} already has a master chunk")
            self._settle(chunk)
            master = chunk.clone_layout(dtype, copy_values=True, residence=residence)
            chunk.paired, master.paired = master, chunk
            self._masters[id(chunk)] = master
            self._add(master.memory_usage())
            masters.append(master)
        return masters

    def master_chunk(self, chunk: Chunk) -> Chunk:
        try:
            return self._masters[id(chunk)]
        except KeyError:
            raise KeyError(f"chunk {chunk.chunk_id} has no master chunk; call create_master_chunks") from None

    def grad_chunk(self, chunk: Chunk, residence: Residence = Residence.DEVICE) -> Chunk:
        """The gradient chunk of `chunk` (same layout, zero own slice), created on first call."""
        grad = self._grads.get(id(chunk))
        if grad is None:
            self._settle(chunk)
            grad = chunk.clone_layout(chunk.dtype, copy_values=False, residence=residence)
            self._grads[id(chunk)] = grad
            self._add(grad.memory_usage())
        return grad

    def create_state_chunk(
        self,
        chunk: Chunk,
        name: str,
        dtype: torch.dtype = torch.float32,
        residence: Residence = Residence.DEVICE,
    ) -> Chunk:
        """A zero chunk with `chunk`'s layout for optimizer state `name` (e.g. "exp_avg"), accounted here."""
        key = (id(chunk), name)
        if key in self._states:
            raise ChunkError(f"chunk {chunk.chunk_id} already has a state chunk named {name!r}")
        state = chunk.clone_layout(dtype, copy_values=False, residence=residence)
        self._states[key] = state
        self._add(state.memory_usage())
        return state

    def state_chunk(self, chunk: Chunk, name: str) -> Chunk:
        try:
            return self._states[(id(chunk), name)]
        except KeyError:
            raise KeyError(f"chunk {chunk.chunk_id} has no state chunk named {name!r}") from None

    def companions(self, chunk: Chunk) -> list[Chunk]:
        """The master, gradient and optimizer-state chunks that share `chunk`'s layout (what
        `PlacementPolicy.optimizer_residence` places)."""
        found = [c for c in (self._masters.get(id(chunk)), self._grads.get(id(chunk))) if c is not None]
        return found + [state for (owner, _), state in self._states.items() if owner == id(chunk)]

    def has_grad_chunk(self, chunk: Chunk) -> bool:
        return id(chunk) in self._grads

    def write_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Place a gradient in the tensor's slot of its (gathered) parameter chunk, as Gemini does without
        accumulation: the parameter values there are no longer needed once backward has used them."""
        chunk = self.get_chunk(tensor)
        self._settle(chunk)
        chunk.write(tensor, grad)

    def accumulate_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Add a gradient into the tensor's slot of its gradient chunk's local buffer (allocated on demand)."""
        grad_chunk = self.grad_chunk(self.get_chunk(tensor))
        self._settle(grad_chunk)
        if not grad_chunk.is_gathered:
            self._tracked(grad_chunk, grad_chunk.open_buffer)
        grad_chunk.accumulate(tensor, grad)

    def write_grad_in_buffer(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Put a gradient into the tensor's slot of its gathered parameter chunk (`Chunk.write_grad_in_buffer`); the
        next `reduce_chunk` adds the reduced slice into the gradient chunk. Saves a full-size gradient buffer."""
        chunk = self.get_chunk(tensor)
        self.grad_chunk(chunk)
        self._settle(chunk)
        if chunk.grads_in_buffer:  # only the first write can change storage (the own slice copied aside)
            chunk.write_grad_in_buffer(tensor, grad)
            return
        with self._accounting(chunk):
            chunk.write_grad_in_buffer(tensor, grad)

    def zero_grad_chunks(self, set_to_none: bool = True) -> None:
        """Forget every gradient chunk's reduced gradients: free their own slices (the next reduction creates
        them again, so no gradient memory exists between a step and the next backward), or zero them."""
        for grad in self._grads.values():
            self._settle(grad)
            if set_to_none and not grad.is_gathered:
                self._tracked(grad, grad.discard_own_slice)
            elif grad.has_own_slice:
                grad.shard_tensor().zero_()

    # ------------------------------------------------------------------------------------------- accounting
    def reset_peak(self) -> None:
        self._peak = self._usage

    def recount(self) -> MemoryUsage:
        """The usage recomputed from every chunk (what `usage` must always equal)."""
        total = MemoryUsage()
        for chunk in self.all_chunks():
            total = total + chunk.memory_usage()
        return total

    def _note_transient(self, chunk: Chunk, extra: int) -> None:
        """Raise the device peak for an operation that briefly holds `extra` more bytes than before or after it
        (only for chunks whose own slice is a part of the chunk: otherwise nothing is copied)."""
        if chunk.shard_size != chunk.chunk_size:
            self._peak = MemoryUsage(max(self._peak.device, self._usage.device + extra), self._peak.host)

    def _add(self, delta: MemoryUsage) -> None:
        self._usage = self._usage + delta
        self._peak = MemoryUsage(max(self._peak.device, self._usage.device), max(self._peak.host, self._usage.host))

    def _settle(self, chunk: Chunk) -> None:
        """Complete a pending asynchronous gather under accounting before a chunk method would complete it
        implicitly (completing frees the own slice, which the usage figures must see)."""
        if chunk.gather_pending:
            self._tracked(chunk, chunk.wait)

    def _tracked(self, chunk: Chunk, operation: Callable[[], _T]) -> _T:
        with self._accounting(chunk):
            return operation()

    @contextlib.contextmanager
    def _accounting(self, chunk: Chunk) -> Iterator[None]:
        before = chunk.memory_usage()
        try:
            yield
        finally:
            self._add(chunk.memory_usage() - before)

    def _tracked_append(self, chunk: Chunk, tensor: torch.Tensor, name: str | None) -> None:
        chunk.append(tensor, name)
        self._tensor_chunk[id(tensor)] = chunk

    def _new_chunk(self, size: int, dtype: torch.dtype) -> Chunk:
        chunk = Chunk(
            size,
            dtype,
            self.group,
            keep_gathered=self.config.keep_gathered,
            chunk_id=self._next_id,
            extra_dp_group=self.extra_dp_group,
            pin_memory=self.pin_memory,
            compute_device=self.compute_device,
            init_device=self.init_device,
            fp8_communication=self.fp8_communication,
        )
        self._next_id += 1
        self._add(chunk.memory_usage())
        return chunk
