"""Loading a cx checkpoint into DTensor parameters: each rank reads only its shard's region (uneven shards, a
sharded second dimension, replicated tensors), and placements it cannot map raise instead of loading wrongly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from cx_checkpoint import (
    CheckpointKind,
    CheckpointReader,
    DTensorModuleSink,
    GeneralCheckpointIO,
    load_into,
    local_region,
)
from cx_mesh.testing import distributed


class _Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rows = nn.Parameter(torch.arange(15.0).reshape(5, 3))  # 5 rows over 2 ranks: 3 + 2
        self.cols = nn.Parameter(torch.arange(6.0).reshape(2, 3) + 100)
        self.whole = nn.Parameter(torch.tensor([7.0, 8.0]))


def _distributed_copy(mesh: DeviceMesh) -> nn.Module:
    module = _Three()
    with torch.no_grad():
        for param in module.parameters():
            param.zero_()
    placements: dict[str, list[Placement]] = {"rows": [Shard(0)], "cols": [Shard(1)], "whole": [Replicate()]}
    for name, placement in placements.items():
        sharded = distribute_tensor(getattr(module, name).detach(), mesh, placement)
        setattr(module, name, nn.Parameter(sharded))
    return module


@distributed(world_size=2)
def test_dtensor_sink_reads_each_ranks_region(rank: int, world_size: int, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    if rank == 0:
        GeneralCheckpointIO().save_model(_Three(), path, use_safetensors=True)
    dist.barrier()
    mesh = DeviceMesh("cpu", list(range(world_size)))
    module = _distributed_copy(mesh)
    sink = DTensorModuleSink(module)
    assert sink.owned_region("rows") == ((slice(0, 3),) if rank == 0 else (slice(3, 5),)) + (slice(0, 3),)
    assert sink.owned_region("cols") == (slice(0, 2), slice(0, 2) if rank == 0 else slice(2, 3))
    assert sink.owned_region("whole") == (slice(0, 2),)
    with CheckpointReader.open(path, CheckpointKind.MODEL) as reader:
        load_into(reader, sink, strict=True)
    expected = _Three()
    for name, param in module.named_parameters():
        assert isinstance(param, DTensor)
        torch.testing.assert_close(param.full_tensor(), getattr(expected, name).detach(), msg=name)


@distributed(world_size=2)
def test_dtensor_region_refuses_partial_placements(rank: int, world_size: int) -> None:
    mesh = DeviceMesh("cpu", list(range(world_size)))
    partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])  # a pending sum: no region holds its value
    with pytest.raises(NotImplementedError, match="not supported"):
        local_region(partial)
