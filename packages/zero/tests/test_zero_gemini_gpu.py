"""Gemini on CUDA: run by `nox -s gpu` on a machine with a GPU, skipped elsewhere.

Chunks live on the rank's GPU and the model computes there; the reference is single-process PyTorch on the CPU.
NCCL with one rank per GPU, and gloo with two ranks sharing one GPU (collectives then go through the host, the path
`communication_device` picks for gloo). SGD keeps CPU/GPU kernel rounding differences at rounding level (Adam's
sign-like update would turn a near-zero gradient's rounding into a +-lr step).
"""

from __future__ import annotations

import pytest
import torch

from cx_mesh.testing import spawn
from cx_zero.gemini import GeminiDDP, GeminiOptimizer
from zero_gemini_helpers import Reference, assert_state_close, batch, lm_loss, local, make_gpt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TOLERANCE = {"fp32": (1e-4, 1e-5), "bf16": (3e-2, 3e-2)}


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _parity(rank: int, world_size: int, precision: str, placement: dict[str, object]) -> None:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    reference = Reference(make_gpt(), world_size, _sgd, dtype=dtype)
    ddp = GeminiDDP(make_gpt(), chunk_config_dict={"chunk_size": 2048}, mixed_precision=dtype, **placement)  # type: ignore[arg-type]
    assert ddp.compute_device.type == "cuda"
    optimizer = GeminiOptimizer(_sgd(list(ddp.parameters())), ddp, max_norm=1.0)
    reference.max_norm = 1.0
    rtol, atol = TOLERANCE[precision]
    for step in range(3):
        x, y = batch(step, world_size)
        optimizer.zero_grad()
        logits = ddp(local(x, rank, world_size).to(ddp.compute_device))
        optimizer.backward(lm_loss(logits, local(y, rank, world_size).to(ddp.compute_device)))
        optimizer.step()
        reference.step(step)
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state(), rtol, atol, f"step {step}")
    for chunk in ddp.manager.chunks():  # the values live on the GPU: the own slice, or the master's
        holder = chunk if chunk.has_own_slice else ddp.manager.master_chunk(chunk)
        assert holder.memory_usage().device > 0
    torch.cuda.synchronize()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_gemini_gpu_nccl_matches_pytorch(precision: str) -> None:
    world_size = min(2, torch.cuda.device_count())
    spawn(_parity, world_size, precision, {}, backend="nccl", timeout=300)


def test_zero_gemini_gpu_two_ranks_on_one_gpu_over_gloo() -> None:
    spawn(_parity, 2, "fp32", {"max_prefetch": 2}, backend="gloo", timeout=300)


def test_zero_gemini_gpu_optimizer_offload() -> None:
    spawn(_parity, 2, "bf16", {"offload_optim_frac": 1.0}, backend="gloo", timeout=300)


def test_zero_gemini_gpu_chunk_init_device_cpu_computes_on_the_gpu() -> None:
    """chunk_init_device=cpu (ColossalAI: where chunks are first built) on a GPU machine: the model is built on the
    CPU, its chunks are built there, and everything then lives and computes on the GPU (`_parity` checks the
    compute device and that each chunk's values are GPU-resident), matching PyTorch."""
    world_size = min(2, torch.cuda.device_count())
    spawn(_parity, world_size, "fp32", {"chunk_init_device": torch.device("cpu")}, backend="nccl", timeout=300)
