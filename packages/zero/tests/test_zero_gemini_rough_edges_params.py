"""Gemini's rough edges (issue 11), what GeminiDDP holds after wrapping: parameters unfrozen or frozen later,
BatchNorm buffers (rank-local during training), and chunk_init_device (only where chunks are built). Each case is
checked against single-process PyTorch, or for a clear error on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cx_chunk import Residence
from cx_mesh import CpuAccelerator, get_accelerator, set_accelerator
from cx_mesh.testing import distributed
from cx_zero.gemini import GeminiDDP, GeminiOptimizer
from zero_gemini_helpers import assert_state_close, local
from zero_gemini_rough_models import (
    ATOL,
    BLOCK_NUMEL,
    DIM,
    RTOL,
    Block,
    adamw,
    build_mlp,
    build_stack,
    regression,
    sgd,
)


# ---------------------------------------------------------------------------- (un)freezing after wrapping
class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.embed.requires_grad_(False)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(self.embed(x)))
        return out


def _frozen(seed: int = 0) -> Frozen:
    torch.manual_seed(seed)
    return Frozen()


@distributed(world_size=2)
@pytest.mark.parametrize("config", [None, {"chunk_size": BLOCK_NUMEL}])
def test_zero_gemini_rough_edges_unfreezing_after_wrapping_raises(
    rank: int, world_size: int, config: dict[str, int] | None
) -> None:
    """A parameter frozen when GeminiDDP was built lives in a chunk without gradient or optimizer state: setting
    requires_grad=True later raises on every rank at the next training forward, naming it, before any full-size
    `.grad` appears; freezing it again lets training go on, matching PyTorch."""
    reference = _frozen()
    ref_optimizer = adamw([p for p in reference.parameters() if p.requires_grad])
    model = _frozen()
    ddp = GeminiDDP(model, chunk_config_dict=config, mixed_precision=torch.float32)
    optimizer = GeminiOptimizer(adamw([p for p in ddp.parameters() if p.requires_grad]), ddp)

    def step(index: int) -> None:
        x, y = regression(index, world_size)
        optimizer.zero_grad()
        optimizer.backward(F.mse_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size)))
        optimizer.step()
        ref_optimizer.zero_grad()
        losses = [F.mse_loss(reference(local(x, r, world_size)), local(y, r, world_size)) for r in range(world_size)]
        torch.stack(losses).mean().backward()
        ref_optimizer.step()
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state_dict(), RTOL, ATOL, f"step {index}")

    step(0)
    model.embed.weight.requires_grad_(True)  # on every rank
    x, _y = regression(1, world_size)
    with pytest.raises(RuntimeError, match=r"requires_grad=True.*\['embed\.weight'\].*frozen when"):
        ddp(local(x, rank, world_size))
    assert model.embed.weight.grad is None
    model.embed.weight.requires_grad_(False)
    step(1)
    assert model.embed.weight.grad is None
    assert model.embed.bias.grad is None


@distributed(world_size=2)
def test_zero_gemini_rough_edges_unfreezing_on_one_rank_raises_everywhere(rank: int, world_size: int) -> None:
    model = _frozen()
    ddp = GeminiDDP(model, chunk_config_dict={"chunk_size": BLOCK_NUMEL}, mixed_precision=torch.float32)
    if rank == 1:
        model.embed.bias.requires_grad_(True)
    x, _ = regression(0, world_size)
    with pytest.raises(RuntimeError, match=r"requires_grad=True.*'embed\.bias'"):
        ddp(x)


@distributed(world_size=2)
def test_zero_gemini_rough_edges_freezing_after_wrapping_matches_pytorch(rank: int, world_size: int) -> None:
    """A trainable parameter frozen after wrapping gets no gradient and is skipped by the optimizer, as in PyTorch
    (weight decay and momentum leave it alone), while the rest of its chunk trains."""
    reference = build_mlp()
    ref_optimizer = adamw(list(reference.parameters()))
    model = build_mlp()
    ddp = GeminiDDP(model, chunk_config_dict={"chunk_size": BLOCK_NUMEL}, mixed_precision=torch.float32)
    optimizer = GeminiOptimizer(adamw(list(ddp.parameters())), ddp)
    for index in range(3):
        if index == 1:
            for m in (model, reference):
                m.get_parameter("blocks.0.fc.weight").requires_grad_(False)
        x, y = regression(index, world_size)
        optimizer.zero_grad()
        optimizer.backward(F.mse_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size)))
        optimizer.step()
        ref_optimizer.zero_grad()
        losses = [F.mse_loss(reference(local(x, r, world_size)), local(y, r, world_size)) for r in range(world_size)]
        torch.stack(losses).mean().backward()
        ref_optimizer.step()
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state_dict(), RTOL, ATOL, f"step {index}")


# ---------------------------------------------------------------------------------------------------- buffers
class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.bn(self.fc(x)))
        return out


@distributed(world_size=2)
@pytest.mark.parametrize("config", [None, {"chunk_size": 2 * DIM * DIM}])
def test_zero_gemini_rough_edges_batchnorm_buffers(rank: int, world_size: int, config: dict[str, int] | None) -> None:
    """BatchNorm's running statistics are broadcast from rank 0 when wrapping (ranks built with different seeds and
    statistics start identical). During training each rank updates them from its own micro-batch, as DDP with
    broadcast_buffers=False and ColossalAI's Gemini do: rank r's statistics equal a single-process BatchNorm fed
    rank r's batches; parameters match data-parallel PyTorch; rank 0's statistics are what state_dict saves."""
    torch.manual_seed(1)
    model = Normed()
    with torch.no_grad():
        model.bn.running_mean.fill_(float(rank + 1))  # type: ignore[union-attr]
        model.bn.num_batches_tracked.fill_(rank * 7)  # type: ignore[union-attr]
    ddp = GeminiDDP(model, chunk_config_dict=config, mixed_precision=torch.float32)
    torch.manual_seed(1)
    base = Normed()  # rank 0's model
    with torch.no_grad():
        base.bn.running_mean.fill_(1.0)  # type: ignore[union-attr]
    assert_state_close(ddp.state_dict(only_rank_0=False), base.state_dict(), 0, 0, "wrapped")
    stats = [{k: v.clone() for k, v in base.named_buffers()} for _ in range(world_size)]  # per rank
    ref_optimizer = sgd(list(base.parameters()))
    optimizer = GeminiOptimizer(sgd(list(ddp.parameters())), ddp)
    for index in range(3):
        x, y = regression(index, world_size)
        optimizer.zero_grad()
        optimizer.backward(F.mse_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size)))
        optimizer.step()
        grads = []
        for r in range(world_size):  # replica r: the shared parameters, rank r's own statistics
            replica = copy.deepcopy(base)
            replica.load_state_dict(stats[r], strict=False)
            loss = F.mse_loss(replica(local(x, r, world_size)), local(y, r, world_size))
            grads.append(torch.autograd.grad(loss, list(replica.parameters())))
            stats[r] = {k: v.clone() for k, v in replica.named_buffers()}
        ref_optimizer.zero_grad()
        for p, *gs in zip(base.parameters(), *grads, strict=True):
            p.grad = torch.stack(gs).sum(0) / world_size
        ref_optimizer.step()
        got = ddp.state_dict(only_rank_0=False)
        want = {**base.state_dict(), **stats[rank]}
        assert_state_close(got, want, RTOL, ATOL, f"rank {rank} step {index}")
        assert not torch.equal(stats[0]["bn.running_mean"], stats[1]["bn.running_mean"])  # they do drift apart
    saved = ddp.state_dict()  # only_rank_0: rank 0's statistics
    if rank == 0:
        torch.testing.assert_close(saved["bn.running_mean"], stats[0]["bn.running_mean"], rtol=RTOL, atol=ATOL)
    else:
        assert saved == {}


# ----------------------------------------------------------------------------------------------- chunk_init_device
class _CountingAccelerator(CpuAccelerator):
    """The CPU accelerator, counting how often cx asks it for the compute device."""

    asked = 0

    def current_device(self) -> torch.device:
        type(self).asked += 1
        return super().current_device()


@distributed(world_size=2)
def test_zero_gemini_rough_edges_chunk_init_device_only_says_where_chunks_are_built(rank: int, world_size: int) -> None:
    """`chunk_init_device` says where chunks are built; they compute on the accelerator's current device (ColossalAI's
    meaning), which GeminiDDP asks the accelerator for. On this CPU-only machine both are the CPU; the GPU test
    (test_zero_gemini_gpu) checks chunk_init_device=cpu computing on CUDA against PyTorch. Other devices are
    refused."""
    previous = get_accelerator()
    set_accelerator(_CountingAccelerator())
    try:
        ddp = GeminiDDP(
            build_stack(),
            chunk_config_dict={"chunk_size": BLOCK_NUMEL},
            mixed_precision=torch.bfloat16,
            chunk_init_device=torch.device("cpu"),
        )
        assert _CountingAccelerator.asked > 0
    finally:
        set_accelerator(previous)
    assert ddp.chunk_init_device == torch.device("cpu")
    assert ddp.compute_device == get_accelerator().current_device()
    for chunk in ddp.manager.chunks():
        assert chunk.compute_device == ddp.compute_device
        assert ddp.manager.master_chunk(chunk).residence is Residence.DEVICE
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(rank))
    reference = build_stack().to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(ddp(x).float(), reference(x.to(torch.bfloat16)).float())
    with pytest.raises(ValueError, match=r"chunk_init_device must be the CPU or the accelerator \(cpu\), got meta"):
        GeminiDDP(build_stack(), chunk_init_device=torch.device("meta"))
