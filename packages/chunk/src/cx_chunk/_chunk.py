"""`Chunk`: one 1-D buffer of `chunk_size` elements holding many tensors back to back, sharded over a group.

Storage model (what exists when):
- open (before `close`): the full buffer on the compute device, or on the CPU when `init_device` says so (building a
  model's chunks without holding it whole on the accelerator, as ColossalAI's `chunk_init_device`); appended tensors
  point into it. Closing moves what remains (the own slice, or the kept buffer) to the compute device.
- sharded, released: only this rank's own slice (`chunk_size / group_size` elements) exists, on the device or the
  host (`move`); the chunk's tensors point at empty storage.
- gathered: the full buffer on the compute device; the own slice is a view into it; tensors point at their slots.
- keep_gathered chunks are never sharded: the full buffer is the storage (it can still be moved to the host).
- gradient/master chunks built with `clone_layout` keep a separate own-slice tensor and may also hold a full buffer
  of local (unreduced) gradients; `reduce(accumulate=True)` adds the reduced slice into the own slice.
- a parameter chunk paired with a master chunk on the device keeps no own slice while released: its values are
  the master's, cast when the chunk is gathered (`has_own_slice` is False).
- gradients in the buffer (`write_grad_in_buffer`): a gathered parameter chunk whose parameters are done with in
  backward takes their gradients into their own slots, so no second full-size buffer is needed; the own slice of
  parameter values is copied aside first (or cast back from the master chunk) and is all that remains after
  `reduce_into` the gradient chunk.
Memory usage is computed from the tensors that exist, so it is exact by construction.

fp8 communication (`fp8_communication=True`, Gemini's switch): gradient reductions (reduce-scatter, the all-reduce of
keep_gathered chunks and over `extra_dp_group`) go through `cx_mesh.fp8` in E5M2, and the all-gather of a parameter
chunk paired with a master chunk in E4M3 (every rank, the owner too, computes with the dequantized values; the master
keeps the exact ones). A chunk without a master (frozen parameters) gathers in its own dtype: its values are the
only copy and would otherwise be rounded to fp8 by every gather.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cx_chunk._errors import ChunkError, ChunkFullError
from cx_chunk._layout import MemoryUsage, Residence, ShardView, TensorSlot
from cx_chunk._states import TensorState, check_transition
from cx_mesh import (
    ProcessGroup,
    all_gather_flat,
    all_reduce,
    communication_device,
    get_accelerator,
    reduce_scatter_flat,
    reduce_scatter_scratch_numel,
    require_initialized,
)
from cx_mesh.fp8 import all_gather_flat_fp8, all_reduce_fp8, reduce_scatter_flat_fp8, reduce_scatter_scratch_nbytes_fp8

__all__ = ["Chunk"]

_RELEASABLE = frozenset({TensorState.HOLD, TensorState.FREE})


@dataclass
class _Entry:
    tensor: torch.Tensor
    slot: TensorSlot
    state: TensorState
    hollow: torch.Tensor | None = None
    """What the tensor shows while its chunk is released: its own shape over a storage of zero bytes (made once),
    so `shape` and `numel()` stay the parameter's (ColossalAI's scripts count parameters after boost) while no
    memory is held; reading its values raises torch's storage-size error."""

    def released_view(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.hollow is None or self.hollow.dtype != dtype or self.hollow.device != device:
            hollow = torch.empty(self.slot.shape, dtype=dtype, device=device)
            hollow.untyped_storage().resize_(0)
            self.hollow = hollow
        return self.hollow


def _with_index(device: torch.device | str) -> torch.device:
    """`cuda` -> `cuda:<current>`: buffers are matched by device (a retired buffer is refilled only on its own
    device), and torch.device("cuda") != torch.device("cuda:0")."""
    device = torch.device(device)
    if str(device) == "cuda":  # no index
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class _Reduction:
    """A reduce-scatter in flight: its handle, input (kept alive until it completes), output, destination."""

    work: dist.Work | None
    source: torch.Tensor
    reduced: torch.Tensor
    target: Chunk
    scratch_nbytes: int  # what the collective allocates besides (see Chunk.reduce_scratch_nbytes)


def _swap_in(tensor: torch.Tensor, view: torch.Tensor) -> None:
    """Make a meta `tensor` (a parameter built lazily) a real one on `view`'s device, in place: the same Python
    object (optimizers and modules that hold it stay valid), same class and `requires_grad`. It gets an empty tensor
    of its own (the caller then points `.data` at its slot, as for any tensor): a tensor made from `view` itself
    would share the chunk buffer's version counter, and every gather would then look like an in-place change of
    the parameter to autograd."""
    empty = torch.empty(0, dtype=view.dtype, device=view.device)
    fresh = (
        nn.Parameter(empty, requires_grad=tensor.requires_grad)
        if isinstance(tensor, nn.Parameter)
        else empty.requires_grad_(tensor.requires_grad)
    )
    fresh.__dict__.update(tensor.__dict__)  # attributes set on the parameter (swap_tensors swaps them too)
    try:
        torch.utils.swap_tensors(tensor, fresh)
    except RuntimeError as error:
        raise ChunkError(
            "a tensor on the meta device could not be placed in its chunk in place because something still holds a "
            "view of it; release views of lazily built parameters first"
        ) from error


class Chunk:
    """A chunk of `chunk_size` elements of one dtype; see the module docstring for its storage model."""

    def __init__(
        self,
        chunk_size: int,
        dtype: torch.dtype,
        group: ProcessGroup | None = None,
        *,
        keep_gathered: bool = False,
        chunk_id: int = 0,
        extra_dp_group: ProcessGroup | None = None,
        pin_memory: bool = False,
        compute_device: torch.device | None = None,
        init_device: torch.device | None = None,
        fp8_communication: bool = False,
    ) -> None:
        require_initialized("cx_chunk.Chunk")
        self.fp8_communication = fp8_communication
        if chunk_size <= 0:
            raise ValueError(f"Chunk: chunk_size must be positive, got {chunk_size}")
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if chunk_size % self.group_size != 0:
            raise ValueError(
                f"Chunk: chunk_size {chunk_size} is not a multiple of the group size {self.group_size}; "
                "round it up (search_chunk_configuration does)"
            )
        self.chunk_id = chunk_id
        self.chunk_size = chunk_size
        self.dtype = dtype
        self.keep_gathered = keep_gathered
        self.extra_dp_group = extra_dp_group
        self.pin_memory = pin_memory
        self.compute_device = _with_index(
            compute_device if compute_device is not None else get_accelerator().current_device()
        )
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.shard_size = chunk_size if keep_gathered else chunk_size // self.group_size
        self.shard_begin = 0 if keep_gathered else self.rank * self.shard_size
        self.shard_end = self.shard_begin + self.shard_size
        self.utilized_size = 0
        self.is_closed = False
        self.paired: Chunk | None = None
        self._entries: dict[int, _Entry] = {}
        self._order: list[_Entry] = []
        self._repoint = True
        built = self.compute_device if init_device is None else _with_index(init_device)
        if built not in (self.compute_device, torch.device("cpu")):
            raise ValueError(
                f"Chunk: init_device must be the compute device ({self.compute_device}) or the CPU, got {built}"
            )
        self._buffer: torch.Tensor | None = torch.zeros(chunk_size, dtype=dtype, device=built)
        self._buffer_residence = Residence.DEVICE if built == self.compute_device else Residence.HOST
        self._shard: torch.Tensor | None = None
        self._shard_residence = Residence.DEVICE
        self._pending: dist.Work | None = None
        self._grads_in_buffer: set[int] | None = None  # ids of tensors whose slot holds a gradient (see module doc)
        self._reduction: _Reduction | None = None
        self._retired: torch.Tensor | None = None  # the last full buffer, its storage resized to nothing
        self._pending_source: torch.Tensor | None = None

    # ----------------------------------------------------------------------------------------------- layout
    def __repr__(self) -> str:
        return (
            f"Chunk(id={self.chunk_id}, size={self.chunk_size}, dtype={self.dtype}, tensors={len(self._order)}, "
            f"gathered={self.is_gathered}, keep_gathered={self.keep_gathered}, residence={self.residence.value})"
        )

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensors in this chunk, in append order."""
        return [entry.tensor for entry in self._order]

    @property
    def slots(self) -> list[TensorSlot]:
        return [entry.slot for entry in self._order]

    def __contains__(self, tensor: object) -> bool:
        return isinstance(tensor, torch.Tensor) and id(tensor) in self._entries

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.tensors)

    def slot(self, tensor: torch.Tensor) -> TensorSlot:
        return self._entry(tensor).slot

    @property
    def nbytes(self) -> int:
        """Bytes of the full (gathered) chunk."""
        return self.chunk_size * self.element_size

    @property
    def shard_nbytes(self) -> int:
        return self.shard_size * self.element_size

    def has_room(self, numel: int) -> bool:
        return not self.is_closed and self.utilized_size + numel <= self.chunk_size

    def append(self, tensor: torch.Tensor, name: str | None = None) -> TensorSlot:
        """Copy `tensor` into the next free slot and re-point its data there; returns the slot. A tensor on the meta
        device has no values to copy: its slot holds zeros until written (`write`, or the own slice)."""
        if self.is_closed:
            raise ChunkError(f"chunk {self.chunk_id} is closed: no tensor can be appended")
        if tensor.dtype != self.dtype:
            raise ValueError(f"chunk {self.chunk_id} holds {self.dtype}, cannot append a {tensor.dtype} tensor")
        if id(tensor) in self._entries:
            raise ValueError(f"tensor {self._entries[id(tensor)].slot.name!r} is already in chunk {self.chunk_id}")
        numel = tensor.numel()
        if not self.has_room(numel):
            raise ChunkFullError(
                f"chunk {self.chunk_id}: tensor of {numel} elements does not fit "
                f"({self.chunk_size - self.utilized_size} of {self.chunk_size} free)"
            )
        assert self._buffer is not None
        slot = TensorSlot(
            name or f"tensor{len(self._order)}", tensor.shape, self.utilized_size, self.utilized_size + numel
        )
        if not tensor.is_meta:  # a meta tensor (built lazily) has no values yet: its owner writes them later
            self._buffer[slot.begin : slot.end].copy_(tensor.detach().reshape(-1))
        view = self._buffer[slot.begin : slot.end].view(slot.shape)
        if tensor.is_meta:  # `.data` cannot leave the meta device: swap the tensor itself (its identity is kept)
            _swap_in(tensor, view)
        entry = _Entry(tensor, slot, TensorState.HOLD)
        self._entries[id(tensor)] = entry
        self._order.append(entry)
        self.utilized_size += numel
        tensor.data = view
        return slot

    def close(self) -> None:
        """Freeze the layout; a sharded chunk then keeps only its own slice (the tensors become empty)."""
        if self.is_closed:
            raise ChunkError(f"chunk {self.chunk_id} is already closed")
        self.is_closed = True
        built_on_host = self._buffer_residence is Residence.HOST
        if not self.keep_gathered:
            self._scatter()
        if built_on_host:  # init_device: built on the host; the chunk lives and computes on the compute device
            self.move(Residence.DEVICE)

    # ------------------------------------------------------------------------------------------------ states
    def tensor_state(self, tensor: torch.Tensor) -> TensorState:
        return self._entry(tensor).state

    def transition(self, tensor: torch.Tensor, new: TensorState) -> None:
        """Move one tensor to `new`; raises `IllegalTransitionError` naming the tensor and both states."""
        entry = self._entry(tensor)
        check_transition(entry.slot.name, entry.state, new)
        entry.state = new

    def state_counts(self) -> dict[TensorState, int]:
        counts = dict.fromkeys(TensorState, 0)
        for entry in self._order:
            counts[entry.state] += 1
        return counts

    @property
    def can_release(self) -> bool:
        """True when no tensor is in use (all HOLD or FREE) and the chunk may be sharded."""
        return not self.keep_gathered and all(entry.state in _RELEASABLE for entry in self._order)

    @property
    def can_reduce(self) -> bool:
        """True when every tensor's gradient is in place (all READY_FOR_REDUCE)."""
        return bool(self._order) and all(entry.state is TensorState.READY_FOR_REDUCE for entry in self._order)

    # ---------------------------------------------------------------------------------------------- residence
    @property
    def is_gathered(self) -> bool:
        return self._buffer is not None

    @property
    def residence(self) -> Residence:
        """Where the chunk's persistent storage (own slice, or the buffer of a keep_gathered chunk) lives."""
        if self._shard is not None or self._buffer is None:  # no storage at all: where it will be created
            return self._shard_residence
        return self._buffer_residence

    def memory_usage(self) -> MemoryUsage:
        """Bytes of the tensors this chunk holds right now, per device kind."""
        usage = MemoryUsage()
        if self._buffer is not None:
            usage = usage + MemoryUsage.single(self._buffer_residence, self.nbytes)
        if self._shard is not None:
            usage = usage + MemoryUsage.single(self._shard_residence, self._shard.numel() * self.element_size)
        if self._reduction is not None:
            residence = Residence.DEVICE if self._reduction.reduced.device == self.compute_device else Residence.HOST
            extra = self._reduction.reduced.numel()
            if self._reduction.source.data_ptr() != (self._buffer.data_ptr() if self._buffer is not None else 0):
                extra += self._reduction.source.numel()
            usage = usage + MemoryUsage.single(residence, extra * self.element_size + self._reduction.scratch_nbytes)
        return usage

    def gather(self, *, async_op: bool = False) -> bool:
        """Make the full buffer available on the compute device; returns whether an all-gather was issued.

        With `async_op=True` the all-gather is started and completed by `wait()` (any access waits implicitly).
        """
        self._require_closed("gather")
        self.wait()
        if self._reduction is not None:
            raise ChunkError(f"chunk {self.chunk_id}: its gradients are being reduced; finish_reduce first")
        if self._grads_in_buffer is not None:
            return False  # gathered: the slots without a gradient yet still hold parameter values
        if self._buffer is not None and self._shard is None:
            if self._buffer_residence is Residence.HOST:
                self._buffer = self._place(self._buffer, Residence.DEVICE)
                self._buffer_residence = Residence.DEVICE
                self._point_tensors()
            return False
        if self._buffer is not None:
            raise ChunkError(f"chunk {self.chunk_id} holds unreduced gradients; reduce it before gathering")
        own = self.own_values()
        if self.keep_gathered or self.group_size == 1:  # the own slice is the whole chunk: no collective
            self._buffer = self._place(own, Residence.DEVICE)
            self._buffer_residence = Residence.DEVICE
            self._shard = None
            self._point_tensors()
            return False
        comm = communication_device(self.group)
        source = own.to(comm)
        out = self._revive(comm)
        gather = all_gather_flat_fp8 if self.fp8_communication and self.paired is not None else all_gather_flat
        work = gather(out, source, self.group, async_op=async_op)
        self._buffer = out
        self._buffer_residence = Residence.DEVICE
        if async_op:
            self._pending = work
            self._pending_source = source  # alive until the collective has read it
        else:
            self._finish_gather()
        return True

    def wait(self) -> None:
        """Complete an asynchronous gather (no-op when none is pending)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            self._pending_source = None
            self._finish_gather()

    @property
    def gather_pending(self) -> bool:
        return self._pending is not None

    def shard(self, to: Residence | None = None) -> bool:
        """Release the full buffer and keep only the own slice; returns whether anything was freed.

        `to=Residence.HOST` copies the own slice straight to the host (an eviction: no second device copy).
        """
        self._require_closed("shard")
        if self.keep_gathered:
            raise ChunkError(f"chunk {self.chunk_id} is keep_gathered and cannot be sharded")
        self.wait()
        if self._buffer is None:
            return False
        if self._shard is not None or self._grads_in_buffer is not None:
            raise ChunkError(f"chunk {self.chunk_id} holds unreduced gradients; reduce it before sharding")
        busy = [f"{e.slot.name} ({e.state.name})" for e in self._order if e.state not in _RELEASABLE]
        if busy:
            raise ChunkError(f"chunk {self.chunk_id} cannot be sharded while tensors are in use: {', '.join(busy)}")
        self._scatter(to)
        return True

    def move(self, residence: Residence) -> bool:
        """Move the persistent storage to the device or the host; returns whether anything moved."""
        self._require_closed("move")
        self.wait()
        if self._grads_in_buffer is not None:
            raise ChunkError(f"chunk {self.chunk_id} holds unreduced gradients in its buffer; reduce it before moving")
        if self._shard is not None:
            if self._shard_residence is residence:
                return False
            self._shard = self._place(self._shard, residence)
            self._shard_residence = residence
            return True
        if self._buffer is None:  # storage discarded: it will be created there
            self._shard_residence = residence
            return False
        if not self.keep_gathered:
            raise ChunkError(f"chunk {self.chunk_id} is gathered; shard it before moving it")
        if self._buffer_residence is residence:
            return False
        self._buffer = self._place(self._buffer, residence)
        self._buffer_residence = residence
        self._point_tensors()
        return True

    # ------------------------------------------------------------------------------------------------ values
    def tensor_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor's slot in the gathered buffer, shaped like the tensor."""
        slot = self._entry(tensor).slot
        buffer = self._require_buffer("tensor_view")
        return buffer[slot.begin : slot.end].view(slot.shape)

    def write(self, tensor: torch.Tensor, data: torch.Tensor) -> None:
        """Copy `data` (e.g. the tensor's gradient) into the tensor's slot of the gathered buffer."""
        self._slot_data(tensor, data, "write").copy_(data.detach().reshape(-1))

    def accumulate(self, tensor: torch.Tensor, data: torch.Tensor) -> None:
        """Add `data` into the tensor's slot of the gathered buffer."""
        self._slot_data(tensor, data, "accumulate").add_(data.detach().reshape(-1).to(self.dtype))

    def open_buffer(self) -> None:
        """Allocate a zero full buffer on the device without gathering (for local gradients)."""
        self._require_closed("open_buffer")
        self.wait()
        if self._buffer is None:
            self._buffer = torch.zeros(self.chunk_size, dtype=self.dtype, device=self.compute_device)
            self._buffer_residence = Residence.DEVICE
            self._point_tensors()

    def shard_tensor(self) -> torch.Tensor:
        """This rank's own slice (1-D, `shard_size` elements): a view of the buffer when gathered."""
        self.wait()
        if self._shard is not None:
            return self._shard
        if self._buffer is not None:
            return self._buffer[self.shard_begin : self.shard_end]
        raise ChunkError(f"chunk {self.chunk_id} has no storage")

    def shard_views(self) -> list[ShardView]:
        """For each tensor overlapping this rank's own slice: which of its elements are where in the slice."""
        views = []
        for entry in self._order:
            begin = max(entry.slot.begin, self.shard_begin)
            end = min(entry.slot.end, self.shard_end)
            if begin < end:
                views.append(
                    ShardView(
                        entry.slot.name,
                        begin - entry.slot.begin,
                        end - entry.slot.begin,
                        begin - self.shard_begin,
                        end - self.shard_begin,
                    )
                )
        return views

    def shard_view(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The 1-D part of this rank's own slice that holds (part of) `tensor`, or None when none of it is here."""
        slot = self._entry(tensor).slot
        begin, end = max(slot.begin, self.shard_begin), min(slot.end, self.shard_end)
        if begin >= end:
            return None
        return self.shard_tensor()[begin - self.shard_begin : end - self.shard_begin]

    # --------------------------------------------------------------------------------------------- reduction
    def reduce(self, *, accumulate: bool = False) -> None:
        """Average the full buffer's gradients over the group (and the extra data-parallel group).

        Sharded chunks reduce-scatter into the own slice and free the buffer; keep_gathered chunks all-reduce in
        place. With `accumulate=True` the reduced slice is added into the separate own slice (gradient chunks).
        Tensors in READY_FOR_REDUCE go back to HOLD.
        """
        self._require_closed("reduce")
        self.wait()
        buffer = self._require_buffer("reduce")
        comm = communication_device(self.group)
        if self.keep_gathered:
            reduced = buffer.to(comm)
            (all_reduce_fp8 if self.fp8_communication else all_reduce)(reduced, dist.ReduceOp.SUM, group=self.group)
        else:
            reduced = torch.empty(self.shard_size, dtype=self.dtype, device=comm)
            reduce = reduce_scatter_flat_fp8 if self.fp8_communication else reduce_scatter_flat
            reduce(reduced, buffer.to(comm), dist.ReduceOp.SUM, self.group)
        reduced = self._finish_reduce(reduced)
        if accumulate:
            self._add_to_own_slice(reduced)
            self._buffer = None
        elif self.keep_gathered:
            if self._shard is not None:
                raise ChunkError(f"chunk {self.chunk_id} accumulates gradients: call reduce(accumulate=True)")
            if reduced is not buffer:  # reduced in place when the backend takes the buffer's device
                buffer.copy_(reduced)
        else:
            if self._shard is not None:
                raise ChunkError(f"chunk {self.chunk_id} accumulates gradients: call reduce(accumulate=True)")
            self._shard, self._shard_residence = reduced, Residence.DEVICE
            self._drop_buffer()
        self._point_tensors()
        for entry in self._order:
            if entry.state is TensorState.READY_FOR_REDUCE:
                entry.state = TensorState.HOLD

    @property
    def grads_in_buffer(self) -> bool:
        """Whether the gathered buffer holds gradients in some slots (see `write_grad_in_buffer`)."""
        return self._grads_in_buffer is not None

    def write_grad_in_buffer(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Overwrite `tensor`'s slot of the gathered buffer with its gradient (its values are no longer needed in
        this backward). The first call copies this rank's own slice of parameter values aside, unless a master
        chunk on the device holds them (then `reduce_into` casts them back from there)."""
        if self.keep_gathered or self.shard_size == self.chunk_size:
            raise ChunkError(f"chunk {self.chunk_id}: gradients go into the buffer only in sharded chunks")
        if self._reduction is not None:
            raise ChunkError(f"chunk {self.chunk_id}: its gradients are being reduced; no gradient can be added")
        slot = self._slot_data(tensor, grad, "write_grad_in_buffer")
        if self._grads_in_buffer is None:
            assert self._buffer is not None
            assert self._shard is None
            if not self._restorable_from_master():
                self._shard = self._buffer[self.shard_begin : self.shard_end].clone()
                self._shard_residence = self._buffer_residence
            self._grads_in_buffer = set()
        slot.copy_(grad.detach().reshape(-1))
        self._grads_in_buffer.add(id(tensor))

    def reduce_into(self, target: Chunk, *, async_op: bool = False) -> None:
        """Average the gradients in the buffer over the group (and extra data-parallel group), add this rank's
        slice into `target`'s own slice (the gradient chunk) and drop the buffer: the chunk is sharded again.
        Slots that got no gradient count as zeros. Tensors in READY_FOR_REDUCE go back to HOLD.
        With `async_op=True` the reduce-scatter is started and `finish_reduce` completes the rest (until then
        the chunk keeps its buffer, `reducing` is True and it cannot be gathered, sharded or moved)."""
        if self._grads_in_buffer is None:
            raise ChunkError(f"chunk {self.chunk_id}: reduce_into needs gradients written into the buffer")
        if self._reduction is not None:
            raise ChunkError(f"chunk {self.chunk_id}: a reduction is already in flight")
        if target.slots != self.slots or target.shard_begin != self.shard_begin or target.dtype != self.dtype:
            raise ValueError(f"reduce_into: chunk {target.chunk_id} differs from chunk {self.chunk_id} in layout")
        buffer = self._require_buffer("reduce_into")
        for entry in self._order:
            if id(entry.tensor) not in self._grads_in_buffer:
                buffer[entry.slot.begin : entry.slot.end].zero_()
        comm = communication_device(self.group)
        reduced = torch.empty(self.shard_size, dtype=self.dtype, device=comm)
        source = buffer.to(comm)
        reduce = reduce_scatter_flat_fp8 if self.fp8_communication else reduce_scatter_flat
        work = reduce(reduced, source, dist.ReduceOp.SUM, self.group, async_op=async_op)
        self._reduction = _Reduction(work, source, reduced, target, self.reduce_scratch_nbytes)
        if not async_op:
            self.finish_reduce()

    @property
    def reduce_scratch_nbytes(self) -> int:
        """Bytes the reduce-scatter of the buffer allocates inside the collective while in flight, for the
        accounting: gloo's received slices for the plain collective, the packed fp8 messages (one byte per element
        plus a scale per rank, sent and received) with `fp8_communication`."""
        if self.fp8_communication:
            return reduce_scatter_scratch_nbytes_fp8(self.chunk_size, self.group)
        return reduce_scatter_scratch_numel(self.chunk_size, self.group) * self.element_size

    @property
    def reducing(self) -> bool:
        """Whether an asynchronous `reduce_into` waits for `finish_reduce`."""
        return self._reduction is not None

    def finish_reduce(self) -> None:
        """Complete a `reduce_into` (no-op when none is in flight)."""
        reduction = self._reduction
        if reduction is None:
            return
        if reduction.work is not None:
            reduction.work.wait()
        reduced = self._finish_reduce(reduction.reduced)
        reduction.target._add_to_own_slice(reduced)
        # without a copy aside the master slice holds the values: the chunk keeps no own slice until gathered
        self._reduction = None
        self._drop_buffer()
        self._grads_in_buffer = None
        self._point_tensors()
        for entry in self._order:
            if entry.state is TensorState.READY_FOR_REDUCE:
                entry.state = TensorState.HOLD

    def discard_own_slice(self) -> bool:
        """Free the own slice of a gradient chunk (`clone_layout(copy_values=False)`) between steps, like
        `zero_grad(set_to_none=True)`: the next reduction creates it again where `residence` says. Returns whether
        anything was freed."""
        if self._repoint:
            raise ChunkError(f"chunk {self.chunk_id}: only gradient chunks can discard their own slice")
        if self._buffer is not None:
            raise ChunkError(f"chunk {self.chunk_id} holds unreduced gradients; reduce it first")
        freed, self._shard = self._shard is not None, None
        return freed

    @property
    def has_own_slice(self) -> bool:
        """Whether storage for this rank's own slice exists (separately, or inside the gathered buffer)."""
        return self._shard is not None or self._buffer is not None

    def _add_to_own_slice(self, reduced: torch.Tensor) -> None:
        """Accumulate a reduced slice into the own slice, creating it (zero-copy where it can) when discarded."""
        if self._shard is None:
            self._shard = self._place(reduced, self._shard_residence)
        else:
            self._shard.add_(reduced.to(self._shard.device))

    def own_values(self) -> torch.Tensor:
        """This rank's own slice of values wherever they live: the own slice (a view of the buffer when gathered),
        or, for a released chunk that keeps none, its master's slice cast to this chunk's dtype (a copy)."""
        if self.has_own_slice:
            return self.shard_tensor()
        if self.paired is None:
            raise ChunkError(f"chunk {self.chunk_id} has no storage")
        return self.paired.shard_tensor().to(self.compute_device, self.dtype)

    def _restorable_from_master(self) -> bool:
        """A parameter chunk whose paired master chunk (on the device) holds the own slice's values: after a
        reduce_into they are cast back from it instead of being copied aside before the first gradient."""
        master = self.paired
        return master is not None and master.residence is Residence.DEVICE and master.dtype != self.dtype

    def _finish_reduce(self, reduced: torch.Tensor) -> torch.Tensor:
        """Sum over the extra data-parallel group, divide by the number of replicas, back on the compute device."""
        divisor = self.group_size
        if self.extra_dp_group is not None:
            reduce = all_reduce_fp8 if self.fp8_communication else all_reduce
            reduce(reduced, dist.ReduceOp.SUM, group=self.extra_dp_group)
            divisor *= dist.get_world_size(self.extra_dp_group)
        return reduced.div_(divisor).to(self.compute_device)

    # -------------------------------------------------------------------------------------------- pairing
    def clone_layout(
        self, dtype: torch.dtype, *, copy_values: bool = True, residence: Residence = Residence.DEVICE
    ) -> Chunk:
        """A closed chunk with the same layout and group whose own slice is this one's (cast) or zeros.

        The clone does not re-point tensors: its slots are looked up by the same tensors. Used for fp32 master
        chunks (`copy_values=True`) and gradient chunks (`copy_values=False`).
        """
        self._require_closed("clone_layout")
        clone = Chunk.__new__(Chunk)
        clone.__dict__.update(self.__dict__)
        clone.dtype = dtype
        clone.element_size = torch.empty((), dtype=dtype).element_size()
        clone.paired = None
        clone._entries = {}
        clone._order = []
        for entry in self._order:
            copy = _Entry(entry.tensor, entry.slot, TensorState.HOLD)
            clone._entries[id(entry.tensor)] = copy
            clone._order.append(copy)
        clone._repoint = False
        clone._buffer = None
        clone._pending = None
        clone._grads_in_buffer = None
        clone._reduction = None
        clone._retired = None
        clone._pending_source = None
        if copy_values:
            own = self.shard_tensor().to(dtype=dtype, copy=True)
        else:
            own = torch.zeros(self.shard_size, dtype=dtype, device=self.compute_device)
        clone._shard = clone._place(own, residence)
        clone._shard_residence = residence
        return clone

    def copy_shard_from(self, other: Chunk) -> None:
        """Whole-slice copy (with dtype cast) of `other`'s own slice into this one's; layouts must match."""
        if other.chunk_size != self.chunk_size or other.slots != self.slots or other.shard_begin != self.shard_begin:
            raise ValueError(f"copy_shard_from: chunk {other.chunk_id} and chunk {self.chunk_id} differ in layout")
        if self._shard is None and self._buffer is None:
            return  # no own slice to update: the next gather casts the values from `other`, the master
        target = self.shard_tensor()
        target.copy_(other.shard_tensor().to(device=target.device, dtype=target.dtype))

    # -------------------------------------------------------------------------------------------- internals
    def _entry(self, tensor: torch.Tensor) -> _Entry:
        try:
            return self._entries[id(tensor)]
        except KeyError:
            raise KeyError(f"tensor of shape {tuple(tensor.shape)} is not in chunk {self.chunk_id}") from None

    def _require_closed(self, what: str) -> None:
        if not self.is_closed:
            raise ChunkError(f"chunk {self.chunk_id}: {what} needs a closed chunk; call close() first")

    def _require_buffer(self, what: str) -> torch.Tensor:
        self.wait()
        if self._buffer is None:
            raise ChunkError(f"chunk {self.chunk_id}: {what} needs the gathered buffer; gather it first")
        return self._buffer

    def _slot_data(self, tensor: torch.Tensor, data: torch.Tensor, what: str) -> torch.Tensor:
        slot = self._entry(tensor).slot
        if data.numel() != slot.numel:
            raise ValueError(f"{what}: {slot.name!r} has {slot.numel} elements, data has {data.numel()}")
        return self._require_buffer(what)[slot.begin : slot.end]

    def _place(self, tensor: torch.Tensor, residence: Residence) -> torch.Tensor:
        if residence is Residence.DEVICE:
            return tensor.to(self.compute_device)
        host = tensor.to("cpu")
        if self.pin_memory and get_accelerator().is_pin_memory_available() and not host.is_pinned():
            host = host.pin_memory()
        return host

    def _scatter(self, to: Residence | None = None) -> None:
        assert self._buffer is not None
        if self._restorable_from_master() and self.shard_size != self.chunk_size:
            self._shard = None  # the master holds these values: the next gather casts them from there
            self._drop_buffer()
            self._point_tensors()
            return
        own = self._buffer[self.shard_begin : self.shard_end]
        if to is Residence.HOST and self._buffer_residence is Residence.DEVICE:
            placed = self._place(own, Residence.HOST)
            # where host and device are the same memory `placed` is `own` itself: a partial view would keep the
            # whole buffer alive, so copy it
            self._shard = (
                placed if placed.data_ptr() != own.data_ptr() or own.numel() == self.chunk_size else own.clone()
            )
            self._shard_residence = Residence.HOST
        else:
            self._shard = own if self.shard_size == self.chunk_size else own.clone()
            self._shard_residence = self._buffer_residence
        self._drop_buffer()
        self._point_tensors()

    def _finish_gather(self) -> None:
        assert self._buffer is not None
        if _with_index(self._buffer.device) != self.compute_device:  # gathered through the host (gloo + accelerator)
            target = self._revive(self.compute_device)
            target.copy_(self._buffer)
            self._buffer = target
        self._shard = None
        self._point_tensors()

    def _revive(self, device: torch.device) -> torch.Tensor:
        """A full-size buffer on `device`: the retired one with its storage grown back when it lives there (so
        views autograd saved in forward see the values gathered again for backward), else a new one."""
        retired = self._retired
        if retired is not None and retired.device == _with_index(device):
            self._retired = None
            retired.untyped_storage().resize_(self.chunk_size * self.element_size)
            return retired
        return torch.empty(self.chunk_size, dtype=self.dtype, device=device)

    def _drop_buffer(self) -> None:
        """Free the full buffer now, even while autograd holds views of it saved for backward (a parameter chunk's
        tensors point into it): its storage is resized to nothing and the tensor kept for the next gather to
        fill again, as FSDP2 and ColossalAI do. Without this, every buffer released in forward would stay
        allocated until backward, unseen by the accounting."""
        buffer, self._buffer = self._buffer, None
        if buffer is None or not self._repoint:
            return
        storage = buffer.untyped_storage()
        if self._shard is not None and self._shard.untyped_storage().data_ptr() == storage.data_ptr():
            return  # the own slice is the whole buffer: it stays
        storage.resize_(0)
        self._retired = buffer

    def _point_tensors(self) -> None:
        if not self._repoint:
            return
        buffer = self._buffer
        for entry in self._order:
            if buffer is None:
                entry.tensor.data = entry.released_view(self.dtype, self.compute_device)
            else:
                entry.tensor.data = buffer[entry.slot.begin : entry.slot.end].view(entry.slot.shape)
