"""`_ChunkResidence`: where a chunk's values are: gathering the full buffer (all-gather, fp8 for paired chunks),
sharding back to the own slice, moving storage between device and host, and the memory that takes.

One layer of `Chunk` (see `cx_chunk._chunk`), apart from the gradient reductions: these operations only move
parameter values.
"""

from __future__ import annotations

from cx_chunk._chunk_entry import _RELEASABLE
from cx_chunk._chunk_storage import _ChunkStorage
from cx_chunk._errors import ChunkError
from cx_chunk._layout import MemoryUsage, Residence
from cx_mesh import all_gather_flat, communication_device
from cx_mesh.fp8 import all_gather_flat_fp8


class _ChunkResidence(_ChunkStorage):
    """Gather, shard, move and memory accounting of a chunk; `Chunk` is the class to use."""

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
