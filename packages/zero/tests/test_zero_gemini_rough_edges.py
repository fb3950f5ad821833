"""Gemini's rough edges (issue 11): ranks running the same modules in another order, `torch.autograd.grad` before
the real backward. Each case is checked against single-process PyTorch, or for a clear error on every rank.
Parameters (un)frozen after wrapping, buffers and chunk_init_device: test_zero_gemini_rough_edges_params.py;
modules returning dataclasses and other structures: test_zero_gemini_rough_edges_outputs.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cx_mesh.testing import distributed
from cx_zero.gemini import GeminiDDP, GeminiOptimizer, PathMismatchError
from zero_gemini_helpers import assert_state_close, local
from zero_gemini_rough_models import ATOL, BLOCK_NUMEL, DIM, RTOL, adamw, build_mlp, build_stack, regression, sgd


# ---------------------------------------------------------------------------------------------- order of modules
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
        build_stack(),
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
        build_stack(),
        chunk_config_dict={"chunk_size": BLOCK_NUMEL},
        mixed_precision=torch.float32,
        strict_ddp_mode=True,
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
    reference = build_stack()
    ref_optimizer = sgd(list(reference.parameters()))
    ddp = GeminiDDP(
        build_stack(),
        chunk_config_dict={"chunk_size": BLOCK_NUMEL},
        mixed_precision=torch.float32,
        strict_ddp_mode=strict_ddp_mode,
        max_prefetch=2,
    )
    optimizer = GeminiOptimizer(sgd(list(ddp.parameters())), ddp)
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
    reference = build_mlp()
    ref_optimizer = adamw(list(reference.parameters()))
    ddp = GeminiDDP(build_mlp(), chunk_config_dict=config, mixed_precision=torch.float32)
    optimizer = GeminiOptimizer(adamw(list(ddp.parameters())), ddp)
    for step in range(3):
        x, y = regression(step, world_size)
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
    reference = build_mlp()
    ref_optimizer = adamw(list(reference.parameters()))
    ddp = GeminiDDP(build_mlp(), mixed_precision=torch.float32, **options)
    optimizer = GeminiOptimizer(adamw(list(ddp.parameters())), ddp)
    for step in range(3):
        x, y = regression(step, world_size)
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
    ddp = GeminiDDP(build_mlp(), chunk_config_dict={"chunk_size": BLOCK_NUMEL}, mixed_precision=torch.float32)
    x, y = regression(0, world_size)
    with pytest.raises(RuntimeError, match=r"create_graph=True .* not supported while parameters are sharded"):
        _penalised_loss(ddp, x, y)


@distributed(world_size=2)
def test_zero_gemini_rough_edges_second_real_backward_still_raises(rank: int, world_size: int) -> None:
    """What the accumulation guard is for still holds after an input-only gradient."""
    ddp = GeminiDDP(build_mlp(), chunk_config_dict={"chunk_size": BLOCK_NUMEL}, mixed_precision=torch.float32)
    x, y = regression(0, world_size)
    ddp.backward(_adversarial_loss(ddp, x, y))
    with pytest.raises(RuntimeError, match="enable_gradient_accumulation=True"):
        ddp.backward(_adversarial_loss(ddp, x, y))
