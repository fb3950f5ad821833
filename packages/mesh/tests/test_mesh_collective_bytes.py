"""`count_collective_bytes` counts what this rank hands over, gather and scatter included (the whole-matrix optimizer
steps move their gradients and updates with them), once per call."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cx_mesh.testing import count_collective_bytes, distributed


@distributed(world_size=2)
def test_collective_bytes_count_gather_and_scatter(rank: int, world_size: int) -> None:
    piece = torch.full((3,), float(rank))
    gathered = [torch.empty(3) for _ in range(world_size)] if rank == 0 else None
    received = torch.empty(5)
    pieces = [torch.arange(5.0) + r for r in range(world_size)] if rank == 0 else None
    with count_collective_bytes() as counts:
        dist.gather(piece, gathered, dst=0)
        dist.scatter(received, pieces, src=0)
        dist.all_reduce(piece)
    assert counts.by_op["gather"] == 3 * 4  # every rank hands its 3 float32 values
    assert counts.by_op["scatter"] == (world_size * 5 * 4 if rank == 0 else 0)  # only the source hands pieces
    assert counts.by_op["all_reduce"] == 3 * 4
    assert torch.equal(received, torch.arange(5.0) + rank)
