"""Shared helpers for cx-chunk tests: a layered "model" whose layers each fill one chunk, a step driver, and an
independent count of the memory chunks hold."""

from __future__ import annotations

import dataclasses

import torch

from cx_chunk import Chunk, ChunkConfig, ChunkManager, ChunkScheduler, MemoryUsage, Residence, TensorState


def _held(chunk: Chunk) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a chunk object references: its tensor attributes and those of an in-flight reduction."""
    found = [(name, value) for name, value in vars(chunk).items() if isinstance(value, torch.Tensor)]
    reduction = getattr(chunk, "_reduction", None)
    if reduction is not None:
        found += [
            (f"_reduction.{f.name}", getattr(reduction, f.name))
            for f in dataclasses.fields(reduction)
            if isinstance(getattr(reduction, f.name), torch.Tensor)
        ]
    return found


def _scratch_held(work: object) -> int:
    """Bytes of the buffers an in-flight reduce-scatter's handle holds inside the collective, read from the handle
    itself (cx_mesh's private attributes): gloo's received slices for the plain sum, the packed send and receive
    messages for an fp8 one; none for a native reduce-scatter."""
    held = [getattr(work, "_received", None), *getattr(work, "_buffers", ())]
    return sum(t.untyped_storage().nbytes() for t in held if isinstance(t, torch.Tensor))


def _residence(chunk: Chunk, attribute: str, tensor: torch.Tensor) -> Residence:
    if chunk.compute_device.type != "cpu":  # two kinds of memory: where the tensor is says it all
        return Residence.DEVICE if tensor.device == chunk.compute_device else Residence.HOST
    # on a CPU-only machine both kinds are host RAM: the chunk's labels tell an offloaded slice from a resident one
    labels = {"_buffer": chunk._buffer_residence, "_shard": chunk._shard_residence}
    return labels.get(attribute, Residence.DEVICE)


def live_bytes(manager: ChunkManager) -> MemoryUsage:
    """The bytes the manager's chunks really hold, counted from the tensors themselves and not from the figures the
    bookkeeping uses: every distinct storage reachable from a chunk counts once with its full size (a view shares
    its base's storage; a storage resized to nothing counts 0), plus the scratch an in-flight reduce-scatter
    allocates inside the collective, which no tensor of ours shows (read from its handle)."""
    seen: set[tuple[str, int]] = set()
    device = host = 0
    for chunk in manager.all_chunks():
        for attribute, tensor in _held(chunk):
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            if _residence(chunk, attribute, tensor) is Residence.DEVICE:
                device += storage.nbytes()
            else:
                host += storage.nbytes()
        reduction = getattr(chunk, "_reduction", None)
        if reduction is not None:
            device += _scratch_held(reduction.work)
    return MemoryUsage(device, host)


def assert_accounted(manager: ChunkManager) -> None:
    """`usage` equals the independent count, and every registered tensor points into storage that count saw (or
    at nothing): no chunk memory exists that the accounting misses."""
    counted = live_bytes(manager)
    if manager.usage != counted:
        raise AssertionError(f"ChunkManager.usage {manager.usage} differs from the live storages {counted}")
    known = {(str(t.device), t.untyped_storage().data_ptr()) for chunk in manager.all_chunks() for _, t in _held(chunk)}
    for chunk in manager.chunks():
        for tensor, slot in zip(chunk.tensors, chunk.slots, strict=True):
            storage = tensor.untyped_storage()
            if storage.nbytes() and (str(tensor.device), storage.data_ptr()) not in known:
                raise AssertionError(f"{slot.name} points at {storage.nbytes()} bytes no chunk accounts for")


def layered_params(
    layers: int, numel: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> list[list[torch.Tensor]]:
    """`layers` groups of two tensors (weight, bias) with `numel` elements in all per layer."""
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(numel - 3, generator=generator).to(dtype), torch.randn(3, generator=generator).to(dtype)]
        for _ in range(layers)
    ]


def layered_manager(params: list[list[torch.Tensor]], world_size: int) -> ChunkManager:
    """One chunk per layer: the chunk size is a layer's numel rounded up to the group size."""
    numel = sum(p.numel() for p in params[0])
    manager = ChunkManager(ChunkConfig(chunk_size=-(-numel // world_size) * world_size))
    for layer, group in enumerate(params):
        for index, p in enumerate(group):
            manager.register_tensor(p, name=f"layer{layer}.p{index}")
    manager.close_all_groups()
    return manager


def run_period(
    scheduler: ChunkScheduler,
    tensors: list[torch.Tensor],
    non_model_bytes: int = 0,
    expect: list[torch.Tensor] | None = None,
) -> None:
    """One operation: access, compute (state COMPUTE; the values must equal `expect`), release (state HOLD)."""
    scheduler.access(tensors, non_model_bytes=non_model_bytes)
    if expect is not None:
        for tensor, reference in zip(tensors, expect, strict=True):
            if not torch.equal(tensor, reference):
                raise AssertionError(f"tensor of shape {tuple(reference.shape)} changed while its chunk moved")
    scheduler.manager.transition(tensors, TensorState.COMPUTE)
    scheduler.manager.transition(tensors, TensorState.HOLD)
    scheduler.release(tensors)
    assert_accounted(scheduler.manager)
