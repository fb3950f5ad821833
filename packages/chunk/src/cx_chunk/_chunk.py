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

The class is built in layers, one concern per module: `_chunk_storage` (attributes, own slice, internals),
`_chunk_residence` (gather, shard, move, memory usage) and `_chunk_reduction` (gradient reductions); this module adds
the layout (append, close), tensor states, values and pairing.
"""

from __future__ import annotations

import torch

from cx_chunk._chunk_entry import _RELEASABLE, _Entry, _swap_in
from cx_chunk._chunk_reduction import _ChunkReduction
from cx_chunk._chunk_residence import _ChunkResidence
from cx_chunk._errors import ChunkError, ChunkFullError
from cx_chunk._layout import Residence, ShardView, TensorSlot
from cx_chunk._states import TensorState, check_transition

__all__ = ["Chunk"]


class Chunk(_ChunkResidence, _ChunkReduction):
    """A chunk of `chunk_size` elements of one dtype; see the module docstring for its storage model."""

    paired: Chunk | None

    # ----------------------------------------------------------------------------------------------- layout
    def __repr__(self) -> str:
        return (
            f"Chunk(id={self.chunk_id}, size={self.chunk_size}, dtype={self.dtype}, tensors={len(self._order)}, "
            f"gathered={self.is_gathered}, keep_gathered={self.keep_gathered}, residence={self.residence.value})"
        )

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

    # ----------------------------------------------------------------------------------------------- states
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

    # ----------------------------------------------------------------------------------------------- values
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

    # ---------------------------------------------------------------------------------------------- pairing
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
