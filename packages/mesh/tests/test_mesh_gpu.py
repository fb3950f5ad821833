"""CUDA/NCCL checks for cx-mesh; run by `nox -s gpu` on a machine with GPUs, skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cx_mesh import CudaAccelerator, ProcessGroupMesh, assert_same_across_ranks, communication_device
from cx_mesh.testing import spawn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_mesh_gpu_accelerator_facts() -> None:
    accelerator = CudaAccelerator()
    assert accelerator.name == "cuda"
    assert accelerator.communication_backend == "nccl"
    before = accelerator.memory_allocated()
    block = torch.empty(1 << 20, device="cuda")
    assert accelerator.memory_allocated() >= before + block.numel() * 4
    assert accelerator.total_memory() > 2**30
    with accelerator.stream():
        block.add_(1)
    accelerator.synchronize()


def _nccl_mesh(rank: int, world_size: int) -> None:
    assert communication_device().type == "cuda"
    mesh = ProcessGroupMesh(world_size)
    tensor = torch.full((4,), float(rank), device="cuda")
    dist.all_reduce(tensor, group=mesh.get_group_along_axis(0))
    assert tensor.tolist() == [float(sum(range(world_size)))] * 4
    assert_same_across_ranks({"ok": 1}, what="config")
    mesh.destroy_mesh_process_groups()


def test_mesh_gpu_nccl_groups() -> None:
    world_size = min(2, torch.cuda.device_count())
    spawn(_nccl_mesh, world_size, backend="nccl", timeout=120)
