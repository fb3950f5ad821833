"""`_ChunkReduction`: averaging a chunk's gradients over its group: reduce-scatter into the own slice (or
all-reduce a keep_gathered chunk), gradients written into the gathered buffer and reduced into a gradient chunk,
asynchronous reductions, fp8 communication.

One layer of `Chunk` (see `cx_chunk._chunk`), apart from gathering: gradients flow the other way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cx_chunk._chunk_storage import _ChunkStorage, _Reduction
from cx_chunk._errors import ChunkError
from cx_chunk._layout import Residence
from cx_chunk._states import TensorState
from cx_mesh import all_reduce, communication_device, reduce_scatter_flat, reduce_scatter_scratch_numel
from cx_mesh.fp8 import all_reduce_fp8, reduce_scatter_flat_fp8, reduce_scatter_scratch_nbytes_fp8


class _ChunkReduction(_ChunkStorage):
    """Gradient reductions of a chunk; `Chunk` is the class to use."""

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

    def reduce_into(self, target: _ChunkReduction, *, async_op: bool = False) -> None:
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

    def _finish_reduce(self, reduced: torch.Tensor) -> torch.Tensor:
        """Sum over the extra data-parallel group, divide by the number of replicas, back on the compute device."""
        divisor = self.group_size
        if self.extra_dp_group is not None:
            reduce = all_reduce_fp8 if self.fp8_communication else all_reduce
            reduce(reduced, dist.ReduceOp.SUM, group=self.extra_dp_group)
            divisor *= dist.get_world_size(self.extra_dp_group)
        return reduced.div_(divisor).to(self.compute_device)
