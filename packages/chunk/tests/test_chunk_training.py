"""The public API is enough to drive a ZeRO-3 training step by hand (what cx-zero automates with hooks): sharded
chunks, gather around forward and backward, gradients reduced into shards, an SGD step on the fp32 master shard,
copied back. The result must match single-process training on the concatenated batches."""

from __future__ import annotations

import torch
from torch import nn

from _chunk_helpers import assert_accounted
from cx_chunk import ChunkConfig, ChunkManager, ChunkScheduler, StaticPlacementPolicy, TensorState
from cx_mesh.testing import distributed

LR = 0.1
STEPS = 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=generator), torch.randn(4, 3, generator=generator)


def _reference(world_size: int) -> list[torch.Tensor]:
    model = _model()
    for step in range(STEPS):
        model.zero_grad()
        for rank in range(world_size):  # mean over ranks of each rank's mean loss
            x, y = _batch(rank, step)
            (nn.functional.mse_loss(model(x), y) / world_size).backward()
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                p.sub_(LR * p.grad)
    return [p.detach().clone() for p in model.parameters()]


@distributed(world_size=(1, 2, 4))
def test_chunk_manual_zero3_training_matches_single_process(rank: int, world_size: int) -> None:
    model = _model()
    layers = [model[0], model[2]]
    params = list(model.parameters())
    # chunk size 24: the 35-element first weight is an outlier with a chunk of its own; the rest pack next-fit
    manager = ChunkManager(ChunkConfig(chunk_size=24))
    for name, p in model.named_parameters():
        manager.register_tensor(p, name=name)
    manager.close_all_groups()
    masters = manager.create_master_chunks("param")
    scheduler = ChunkScheduler(manager, StaticPlacementPolicy(shard_param_frac=1.0), max_prefetch=1)
    for step in range(STEPS):
        scheduler.begin_step()
        x, y = _batch(rank, step)
        hidden = x
        for module in model:
            own = list(module.parameters(recurse=False))
            if own:
                scheduler.access(own)
                manager.transition(own, TensorState.COMPUTE)
            hidden = module(hidden)
            if own:
                manager.transition(own, TensorState.HOLD)
                scheduler.release(own)
        loss = nn.functional.mse_loss(hidden, y)
        for layer in reversed(layers):  # backward needs the parameters again (cx-zero gathers per module)
            own = list(layer.parameters())
            scheduler.access(own)
            manager.transition(own, TensorState.COMPUTE)
        loss.backward()
        for p in params:
            manager.transition([p], TensorState.HOLD_AFTER_BWD)
            assert p.grad is not None
            manager.write_grad(p, p.grad)
            p.grad = None
            manager.transition([p], TensorState.READY_FOR_REDUCE)
        for chunk in manager.chunks():
            assert chunk.can_reduce
            manager.reduce_chunk(chunk)  # the chunk's own slice now holds the averaged gradient
            master = manager.master_chunk(chunk)
            master.shard_tensor().sub_(LR * chunk.shard_tensor())  # a whole-slice SGD step on the fp32 master
            chunk.copy_shard_from(master)
        scheduler.end_step()
        assert_accounted(manager)
    assert masters
    expected = _reference(world_size)
    for chunk in manager.chunks():
        manager.access_chunk(chunk)
    for p, reference in zip(params, expected, strict=True):
        torch.testing.assert_close(p.detach(), reference, rtol=1e-5, atol=1e-6)
