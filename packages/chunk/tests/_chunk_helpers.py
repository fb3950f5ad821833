"""Shared helpers for cx-chunk tests: a layered "model" whose layers each fill one chunk, and a step driver."""

from __future__ import annotations

import torch

from cx_chunk import ChunkConfig, ChunkManager, ChunkScheduler, TensorState


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
    if scheduler.manager.usage != scheduler.manager.recount():
        raise AssertionError("ChunkManager accounting differs from the chunks' resident bytes")
