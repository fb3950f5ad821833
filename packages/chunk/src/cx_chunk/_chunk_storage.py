"""`_ChunkStorage`: what a `Chunk` holds (full buffer, own slice, tensor entries) and the internals that create,
place and free that storage.

The base of `Chunk` (see `cx_chunk._chunk` for the storage model): the reduction and residence layers, and the chunk
itself, build on these attributes and helpers, so they live in one place and nothing above needs the others.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cx_chunk._chunk_entry import _Entry, _with_index
from cx_chunk._errors import ChunkError
from cx_chunk._layout import Residence, TensorSlot
from cx_mesh import ProcessGroup, get_accelerator, require_initialized


@dataclass
class _Reduction:
    """A reduce-scatter in flight: its handle, input (kept alive until it completes), output, destination."""

    work: dist.Work | None
    source: torch.Tensor
    reduced: torch.Tensor
    target: _ChunkStorage
    scratch_nbytes: int  # what the collective allocates besides (see Chunk.reduce_scratch_nbytes)


class _ChunkStorage:
    """A chunk's storage and its internals; `Chunk` is the class to use."""

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
        self.paired: _ChunkStorage | None = None
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

    # -------------------------------------------------------------------------------------------- residence
    @property
    def is_gathered(self) -> bool:
        return self._buffer is not None

    @property
    def residence(self) -> Residence:
        """Where the chunk's persistent storage (own slice, or the buffer of a keep_gathered chunk) lives."""
        if self._shard is not None or self._buffer is None:  # no storage at all: where it will be created
            return self._shard_residence
        return self._buffer_residence

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

    # -------------------------------------------------------------------------------------------- own slice
    def shard_tensor(self) -> torch.Tensor:
        """This rank's own slice (1-D, `shard_size` elements): a view of the buffer when gathered."""
        self.wait()
        if self._shard is not None:
            return self._shard
        if self._buffer is not None:
            return self._buffer[self.shard_begin : self.shard_end]
        raise ChunkError(f"chunk {self.chunk_id} has no storage")

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
                entry.tensor.data = entry.gathered_view(buffer)
