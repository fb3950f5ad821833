"""Gemini's rough edges (issue 11): ranks running the same modules in another order, `torch.autograd.grad` before
the real backward, parameters unfrozen or frozen after wrapping, modules returning dataclasses and other
structures. Each case is checked against single-process PyTorch, or for a clear error on every rank."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cx_chunk import Residence
from cx_mesh import CpuAccelerator, get_accelerator, set_accelerator
from cx_mesh.testing import distributed
from cx_zero.gemini import GeminiDDP, GeminiOptimizer, PathMismatchError
from zero_gemini_helpers import assert_state_close, local

RTOL, ATOL = 1e-5, 1e-6
DIM = 8


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# ---------------------------------------------------------------------------------------------- order of modules
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(torch.tanh(self.fc(x)))
        return out


BLOCK_NUMEL = DIM * DIM + DIM + 2 * DIM  # one block per chunk with this chunk size


class Stack(nn.Module):
    """Blocks run in the order given: the same parameters in any order."""

    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x: torch.Tensor, order: tuple[int, ...] = (0, 1, 2)) -> torch.Tensor:
        for index in order:
            x = self.blocks[index](x)
        return x


def _stack(seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    return Stack()


@distributed(world_size=2)
@pytest.mark.parametrize(
    ("max_prefetch", "orders"),
    [(0, ((0, 1, 2), (2, 1, 0))), (2, ((1, 0, 2), (2, 1, 0)))],  # with prefetch: both ranks leave the warm-up's order
)
def test_zero_gemini_rough_edges_order_of_modules_differs_raises(
    rank: int, world_size: int, max_prefetch: int, orders: tuple[tuple[int, ...], ...]
) -> None:
    """Rank 0 runs blocks [0, 1, 2], rank 1 [2, 1, 0]: the same parameter set, but same-size all-gathers of
    different chunks pair up. Every rank raises PathMismatchError at the end of that forward, naming the first
    collective that differs on each rank."""
    ddp = GeminiDDP(
        _stack(),
        chunk_config_dict={"chunk_size": BLOCK_NUMEL},
        mixed_precision=torch.float32,
        max_prefetch=max_prefetch,
    )
    assert len(ddp.manager.chunks()) == 3
    assert all(c.shard_size < c.chunk_size for c in ddp.manager.chunks())
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(rank))
    ddp(x).sum().backward()  # warm-up step, order (0, 1, 2) everywhere
    ddp.zero_grad()
    first = [f"blocks\\.{order[0]}\\.fc\\.weight" for order in orders]
    with pytest.raises(PathMismatchError, match=rf"different order in forward.*{first[0]}.*{first[1]}"):
        ddp(x, order=orders[rank])


@distributed(world_size=2)
def test_zero_gemini_rough_edges_order_of_reductions_differs_raises(rank: int, world_size: int) -> None:
    """Chunks kept gathered (strict_ddp_mode) gather nothing in forward, but their all-reduces in backward follow
    the order of the modules: a different order pairs one chunk's gradients with another's. Every rank raises at
    the end of that backward."""
    ddp = GeminiDDP(
        _stack(), chunk_config_dict={"chunk_size": BLOCK_NUMEL}, mixed_precision=torch.float32, strict_ddp_mode=True
    )
    assert len(ddp.manager.chunks()) == 3
    assert all(c.keep_gathered for c in ddp.manager.chunks())
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(rank))
    out = ddp(x, order=(0, 1, 2) if rank == 0 else (2, 1, 0))
    with pytest.raises(PathMismatchError, match=r"different order"):
        ddp.backward(out.sum())


@distributed(world_size=2)
@pytest.mark.parametrize("strict_ddp_mode", [False, True])
def test_zero_gemini_rough_edges_same_order_each_step_matches_pytorch(
    rank: int, world_size: int, strict_ddp_mode: bool
) -> None:
    """The order check does not fire when ranks agree, whatever the order of each step (prefetch on)."""
    reference = _stack()
    ref_optimizer = _sgd(list(reference.parameters()))
    ddp = GeminiDDP(
        _stack(),
        chunk_config_dict={"chunk_size": BLOCK_NUMEL},
        mixed_precision=torch.float32,
        strict_ddp_mode=strict_ddp_mode,
        max_prefetch=2,
    )
    optimizer = GeminiOptimizer(_sgd(list(ddp.parameters())), ddp)
    for step, order in enumerate([(0, 1, 2), (2, 1, 0), (1, 0, 2)]):
        data = torch.randn(world_size * 2, DIM, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        optimizer.backward(ddp(local(data, rank, world_size), order=order).square().mean())
        optimizer.step()
        ref_optimizer.zero_grad()
        sum(reference(local(data, r, world_size), order=order).square().mean() for r in range(world_size)).div(
            world_size
        ).backward()
        ref_optimizer.step()
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state_dict(), RTOL, ATOL, f"step {step}")


# ----------------------------------------------------------------------------------- autograd.grad, then backward
class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(x))
        return out


def _mlp(seed: int = 0) -> Mlp:
    torch.manual_seed(seed)
    return Mlp()


def _regression(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(world_size * 2, DIM, generator=gen), torch.randn(world_size * 2, 1, generator=gen)


def _adversarial_loss(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Fast-gradient-sign adversarial training: the input gradient first (no parameter gradient), then the loss."""
    x = x.clone().requires_grad_(True)
    (grad_x,) = torch.autograd.grad(F.mse_loss(model(x), y), [x])
    return F.mse_loss(model((x + 0.1 * grad_x.sign()).detach()), y)


def _retained_loss(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The input gradient of the same graph (retain_graph=True), then the real backward through it."""
    x = x.clone().requires_grad_(True)
    loss = F.mse_loss(model(x), y)
    torch.autograd.grad(loss, [x], retain_graph=True)
    return loss


@distributed(world_size=2)
@pytest.mark.parametrize("config", [None, {"chunk_size": BLOCK_NUMEL}])
@pytest.mark.parametrize("flow", [_adversarial_loss, _retained_loss])
def test_zero_gemini_rough_edges_autograd_grad_then_backward(
    rank: int,
    world_size: int,
    config: dict[str, int] | None,
    flow: Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """`torch.autograd.grad(loss, inputs)` gives no parameter a gradient: the real backward after it is the step's
    first, not a second one (no enable_gradient_accumulation needed), and the step matches PyTorch."""
    reference = _mlp()
    ref_optimizer = _adamw(list(reference.parameters()))
    ddp = GeminiDDP(_mlp(), chunk_config_dict=config, mixed_precision=torch.float32)
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    for step in range(3):
        x, y = _regression(step, world_size)
        optimizer.zero_grad()
        optimizer.backward(flow(ddp, local(x, rank, world_size), local(y, rank, world_size)))
        optimizer.step()
        ref_optimizer.zero_grad()
        losses = [flow(reference, local(x, r, world_size), local(y, r, world_size)) for r in range(world_size)]
        torch.stack(losses).mean().backward()
        ref_optimizer.step()
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state_dict(), RTOL, ATOL, f"step {step}")


def _penalised_loss(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A gradient penalty: the input gradient with create_graph=True, its square added to the loss."""
    x = x.clone().requires_grad_(True)
    loss = F.mse_loss(model(x), y)
    (grad_x,) = torch.autograd.grad(loss, [x], create_graph=True)
    return loss + 0.1 * grad_x.square().sum()


@distributed(world_size=2)
@pytest.mark.parametrize(
    "options",
    [{}, {"chunk_config_dict": {"chunk_size": BLOCK_NUMEL}, "shard_param_frac": 0.0}, {"strict_ddp_mode": True}],
    ids=["replicated", "zero2", "strict_ddp"],
)
def test_zero_gemini_rough_edges_gradient_penalty_with_gathered_chunks(
    rank: int, world_size: int, options: dict[str, Any]
) -> None:
    """A gradient penalty (double backward through the parameters) matches PyTorch while every chunk stays
    gathered."""
    reference = _mlp()
    ref_optimizer = _adamw(list(reference.parameters()))
    ddp = GeminiDDP(_mlp(), mixed_precision=torch.float32, **options)
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    for step in range(3):
        x, y = _regression(step, world_size)
        optimizer.zero_grad()
        optimizer.backward(_penalised_loss(ddp, local(x, rank, world_size), local(y, rank, world_size)))
        optimizer.step()
        ref_optimizer.zero_grad()
        losses = [_penalised_loss(reference, local(x, r, world_size), local(y, r, world_size)) for r in range(2)]
        torch.stack(losses).mean().backward()
        ref_optimizer.step()
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state_dict(), RTOL, ATOL, f"step {step}")


@distributed(world_size=2)
def test_zero_gemini_rough_edges_gradient_penalty_with_sharded_chunks_raises(rank: int, world_size: int) -> None:
    """With sharded chunks the double-backward graph would read released parameters (a storage-of-size-0 failure
    deep in autograd): the create_graph=True backward raises a clear error instead."""
    ddp = GeminiDDP(_mlp(), chunk_config_dict={"chunk_size": BLOCK_NUMEL}, mixed_precision=torch.float32)
    x, y = _regression(0, world_size)
    with pytest.raises(RuntimeError, match=r"create_graph=True .* not supported while parameters are sharded"):
        _penalised_loss(ddp, x, y)


@distributed(world_size=2)
def test_zero_gemini_rough_edges_second_real_backward_still_raises(rank: int, world_size: int) -> None:
    """What the accumulation guard is for still holds after an input-only gradient."""
    ddp = GeminiDDP(_mlp(), chunk_config_dict={"chunk_size": BLOCK_NUMEL}, mixed_precision=torch.float32)
    x, y = _regression(0, world_size)
    ddp.backward(_adversarial_loss(ddp, x, y))
    with pytest.raises(RuntimeError, match="enable_gradient_accumulation=True"):
        ddp.backward(_adversarial_loss(ddp, x, y))


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
    ref_optimizer = _adamw([p for p in reference.parameters() if p.requires_grad])
    model = _frozen()
    ddp = GeminiDDP(model, chunk_config_dict=config, mixed_precision=torch.float32)
    optimizer = GeminiOptimizer(_adamw([p for p in ddp.parameters() if p.requires_grad]), ddp)

    def step(index: int) -> None:
        x, y = _regression(index, world_size)
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
    x, _y = _regression(1, world_size)
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
    x, _ = _regression(0, world_size)
    with pytest.raises(RuntimeError, match=r"requires_grad=True.*'embed\.bias'"):
        ddp(x)


@distributed(world_size=2)
def test_zero_gemini_rough_edges_freezing_after_wrapping_matches_pytorch(rank: int, world_size: int) -> None:
    """A trainable parameter frozen after wrapping gets no gradient and is skipped by the optimizer, as in PyTorch
    (weight decay and momentum leave it alone), while the rest of its chunk trains."""
    reference = _mlp()
    ref_optimizer = _adamw(list(reference.parameters()))
    model = _mlp()
    ddp = GeminiDDP(model, chunk_config_dict={"chunk_size": BLOCK_NUMEL}, mixed_precision=torch.float32)
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    for index in range(3):
        if index == 1:
            for m in (model, reference):
                m.get_parameter("blocks.0.fc.weight").requires_grad_(False)
        x, y = _regression(index, world_size)
        optimizer.zero_grad()
        optimizer.backward(F.mse_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size)))
        optimizer.step()
        ref_optimizer.zero_grad()
        losses = [F.mse_loss(reference(local(x, r, world_size)), local(y, r, world_size)) for r in range(world_size)]
        torch.stack(losses).mean().backward()
        ref_optimizer.step()
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state_dict(), RTOL, ATOL, f"step {index}")


# ------------------------------------------------------------------------------------- structured outputs
@dataclass
class BlockOutput:
    hidden: torch.Tensor
    extra: dict[str, torch.Tensor]
    note: str = "block"


class Pair(NamedTuple):
    hidden: torch.Tensor
    scale: float


class DataclassBlock(Block):
    def forward(self, x: torch.Tensor) -> BlockOutput:  # type: ignore[override]
        h = super().forward(x)
        return BlockOutput(hidden=h, extra={"square": h.square()})


class PairBlock(Block):
    def forward(self, x: torch.Tensor) -> Pair:  # type: ignore[override]
        return Pair(super().forward(x), 0.5)


class Structured(nn.Module):
    """Inner modules return a dataclass and a NamedTuple; the model returns a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.first = DataclassBlock()
        self.second = PairBlock()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> BlockOutput:
        a = self.first(x)
        b = self.second(a.hidden + 0.1 * a.extra["square"])
        return BlockOutput(hidden=self.head(b.hidden * b.scale), extra={})


def _structured(seed: int = 0) -> Structured:
    torch.manual_seed(seed)
    return Structured()


@distributed(world_size=2)
@pytest.mark.parametrize("config", [None, {"chunk_size": BLOCK_NUMEL}])
def test_zero_gemini_rough_edges_dataclass_outputs_match_pytorch(
    rank: int, world_size: int, config: dict[str, int] | None
) -> None:
    """Modules returning a dataclass (unregistered with pytree), a NamedTuple, and a wrapped model returning a
    dataclass: every unit is gathered again for backward, and training matches PyTorch (fp32 outputs forced)."""
    reference = _structured()
    ref_optimizer = _adamw(list(reference.parameters()))
    ddp = GeminiDDP(_structured(), chunk_config_dict=config, mixed_precision=torch.float32, force_outputs_fp32=True)
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    for index in range(3):
        x, y = _regression(index, world_size)
        optimizer.zero_grad()
        out = ddp(local(x, rank, world_size))
        assert isinstance(out, BlockOutput)
        optimizer.backward(F.mse_loss(out.hidden, local(y, rank, world_size)))
        optimizer.step()
        ref_optimizer.zero_grad()
        losses = [
            F.mse_loss(reference(local(x, r, world_size)).hidden, local(y, r, world_size)) for r in range(world_size)
        ]
        torch.stack(losses).mean().backward()
        ref_optimizer.step()
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state_dict(), RTOL, ATOL, f"step {index}")


class Opaque:
    """Holds a tensor where neither torch's pytree nor dataclass fields can see it."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


class OpaqueBlock(Block):
    def forward(self, x: torch.Tensor) -> Opaque:  # type: ignore[override]
        return Opaque(super().forward(x))


class OpaqueModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = OpaqueBlock()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(x).hidden)
        return out


class CarryingBlock(Block):
    """Returns a tensor and, beside it, an opaque object holding another (as a key/value cache would)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Opaque]:  # type: ignore[override]
        h = super().forward(x)
        return h, Opaque(2 * h)


class CarryingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = CarryingBlock()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(x)[0])
        return out


@distributed(world_size=2)
def test_zero_gemini_rough_edges_opaque_output_raises_naming_its_type(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ddp = GeminiDDP(OpaqueModel(), chunk_config_dict={"chunk_size": BLOCK_NUMEL}, mixed_precision=torch.float32)
    x, _ = _regression(0, world_size)
    with pytest.raises(TypeError, match=r"module 'block' returned a .*Opaque.*register_pytree_node"):
        ddp(x)
    with torch.no_grad():  # without autograd nothing needs gathering again: allowed
        assert ddp(x).shape == (4, 1)
    torch.manual_seed(0)
    reference = CarryingModel()
    torch.manual_seed(0)
    carrying = GeminiDDP(CarryingModel(), chunk_config_dict={"chunk_size": BLOCK_NUMEL}, mixed_precision=torch.float32)
    optimizer = GeminiOptimizer(_sgd(list(carrying.parameters())), carrying)
    ref_optimizer = _sgd(list(reference.parameters()))
    optimizer.backward(carrying(local(x, rank, world_size)).square().mean())  # the visible tensor is enough
    optimizer.step()
    torch.stack([reference(local(x, r, world_size)).square().mean() for r in range(world_size)]).mean().backward()
    ref_optimizer.step()
    assert_state_close(carrying.state_dict(only_rank_0=False), reference.state_dict(), RTOL, ATOL, "carrying")


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
    ref_optimizer = _sgd(list(base.parameters()))
    optimizer = GeminiOptimizer(_sgd(list(ddp.parameters())), ddp)
    for index in range(3):
        x, y = _regression(index, world_size)
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
            _stack(),
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
    reference = _stack().to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(ddp(x).float(), reference(x.to(torch.bfloat16)).float())
    with pytest.raises(ValueError, match=r"chunk_init_device must be the CPU or the accelerator \(cpu\), got meta"):
        GeminiDDP(_stack(), chunk_init_device=torch.device("meta"))
