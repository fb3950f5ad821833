"""GeminiOptimizer: other elementwise optimizers, clipping (2 and inf), fp16 overflow skipping, refusals."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from cx_mesh.testing import distributed
from cx_zero import HybridAdam
from cx_zero.gemini import GeminiDDP, GeminiOptimizer
from zero_gemini_helpers import Reference, assert_state_close, batch, lm_loss, local, make_gpt, train_step

RTOL, ATOL = 1e-5, 1e-6
Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Factory] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
    "hybrid_adam": lambda ps: HybridAdam(ps, lr=1e-2, weight_decay=0.1),
}


def _train(
    rank: int, world_size: int, make: Factory, steps: int, ddp_kwargs: dict[str, object], **optim_kwargs: object
) -> tuple[GeminiDDP, GeminiOptimizer, Reference]:
    reference = Reference(
        make_gpt(),
        world_size,
        make,
        max_norm=float(optim_kwargs.get("max_norm", 0.0)),  # type: ignore[arg-type]
        norm_type=float(optim_kwargs.get("norm_type", 2.0)),  # type: ignore[arg-type]
    )
    ddp = GeminiDDP(make_gpt(), mixed_precision=torch.float32, **ddp_kwargs)  # type: ignore[arg-type]
    optimizer = GeminiOptimizer(make(list(ddp.parameters())), ddp, **optim_kwargs)  # type: ignore[arg-type]
    for step in range(steps):
        train_step(ddp, optimizer, rank, world_size, step)
        reference.step(step)
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state(), RTOL, ATOL, f"step {step}")
        if reference.last_norm is not None:
            norm = optimizer.get_grad_norm()
            assert norm is not None
            assert math.isclose(norm, reference.last_norm, rel_tol=1e-5)
    return ddp, optimizer, reference


@distributed(world_size=2)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_zero_gemini_optimizer_elementwise_optimizers(rank: int, world_size: int, name: str) -> None:
    _train(rank, world_size, OPTIMIZERS[name], 3, {"chunk_config_dict": {"chunk_size": 2048}})


@distributed(world_size=(1, 2))
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("chunk_size", [None, 2048])
def test_zero_gemini_optimizer_clipping_matches_torch(
    rank: int, world_size: int, norm_type: float, chunk_size: int | None
) -> None:
    config = None if chunk_size is None else {"chunk_size": chunk_size}
    _, _, reference = _train(
        rank, world_size, OPTIMIZERS["sgd"], 3, {"chunk_config_dict": config}, max_norm=0.05, norm_type=norm_type
    )
    assert reference.last_norm is not None
    assert reference.last_norm > 0.05


@distributed(world_size=2)
@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_zero_gemini_optimizer_fp16_overflow_skips_step(rank: int, world_size: int, max_norm: float) -> None:
    ddp = GeminiDDP(make_gpt(), chunk_config_dict={"chunk_size": 2048}, mixed_precision=torch.float16)
    optimizer = GeminiOptimizer(
        torch.optim.AdamW(ddp.parameters(), lr=1e-3),
        ddp,
        initial_scale=2**10,
        hysteresis=1,
        growth_interval=1000,
        max_norm=max_norm,
    )
    x, y = batch(0, world_size)
    optimizer.backward(lm_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size)))
    optimizer.step()
    before = ddp.state_dict(only_rank_0=False)
    state_before = optimizer.state_dict(only_rank_0=False)
    # an overflow on rank 0 only: every rank must skip
    loss = lm_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size))
    optimizer.backward(loss * (math.inf if rank == 0 else 1.0))
    optimizer.step()
    assert optimizer.loss_scale == 2**9
    assert_state_close(ddp.state_dict(only_rank_0=False), before, 0.0, 0.0, "after overflow")
    after = optimizer.state_dict(only_rank_0=False)
    for name, entries in state_before["state"].items():
        for key, value in entries.items():
            assert torch.equal(after["state"][name][key], value), (name, key)
    # a clean step afterwards trains again
    optimizer.backward(lm_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size)))
    optimizer.step()
    changed = ddp.state_dict(only_rank_0=False)
    assert any(not torch.equal(changed[k], before[k]) for k in before)


@distributed(world_size=2)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_zero_gemini_optimizer_fp16_clipping_step_reduces_once(rank: int, world_size: int, norm_type: float) -> None:
    """fp16 with clipping: the overflow flag and the norm come from one all-reduce per step, not two."""
    ddp = GeminiDDP(make_gpt(), chunk_config_dict={"chunk_size": 2048}, mixed_precision=torch.float16)
    optimizer = GeminiOptimizer(
        torch.optim.AdamW(ddp.parameters(), lr=1e-3), ddp, initial_scale=2**10, max_norm=1e-3, norm_type=norm_type
    )
    x, y = batch(0, world_size)
    optimizer.backward(lm_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size)))
    original = dist.all_reduce
    calls: list[object] = []

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(kwargs.get("group"))
        return original(*args, **kwargs)  # type: ignore[arg-type]

    setattr(dist, "all_reduce", counting)  # noqa: B010
    try:
        optimizer.step()
    finally:
        setattr(dist, "all_reduce", original)  # noqa: B010
    assert len(calls) == 1
    norm = optimizer.get_grad_norm()
    assert norm is not None
    assert math.isfinite(norm)
    assert norm > 1e-3  # clipped


@distributed(world_size=2)
def test_zero_gemini_optimizer_refuses_non_elementwise(rank: int, world_size: int) -> None:
    ddp = GeminiDDP(make_gpt(), mixed_precision=torch.float32)
    with pytest.raises(TypeError, match=r"not known to be elementwise.*accepted: SGD"):
        GeminiOptimizer(torch.optim.LBFGS(ddp.parameters()), ddp)
    with pytest.raises(TypeError, match="Adafactor"):
        GeminiOptimizer(torch.optim.Adafactor(ddp.parameters()), ddp)
    with pytest.raises(ValueError, match="not a parameter of the GeminiDDP module"):
        GeminiOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1), ddp)
    with pytest.raises(ValueError, match=r"gpu_margin_mem_ratio=0\.5 applies to placement_policy='auto' only"):
        GeminiOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp, gpu_margin_mem_ratio=0.5)
    with pytest.raises(ValueError, match="unsupported norm type"):
        GeminiOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp, norm_type=1.0)
    # a whole-tensor optimizer over tp slices needs the caller's gather over tp (GeminiPlugin passes tp_whole)
    model = make_gpt()
    muon = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2])
    ddp = GeminiDDP(model, mixed_precision=torch.float32)
    with pytest.raises(TypeError, match=r"Muon needs each matrix whole.*tp_group.*pass tp_whole"):
        GeminiOptimizer(muon, ddp, tp_group=dist.group.WORLD)


@distributed(world_size=2)
def test_zero_gemini_optimizer_lr_scheduler_and_param_groups(rank: int, world_size: int) -> None:
    """Two param groups with their own hyper-parameters and a torch LR scheduler on the wrapped optimizer."""

    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])

    reference = Reference(make_gpt(), world_size, make)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(reference.optimizer, step_size=1, gamma=0.5)
    model = make_gpt()
    inner = make(list(model.parameters()))  # groups by shape: build them before wrapping (released params are empty)
    ddp = GeminiDDP(model, chunk_config_dict={"chunk_size": 2048}, mixed_precision=torch.float32)
    optimizer = GeminiOptimizer(inner, ddp)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer.optim, step_size=1, gamma=0.5)
    for step in range(3):
        train_step(ddp, optimizer, rank, world_size, step)
        scheduler.step()
        reference.step(step)
        ref_scheduler.step()
        assert optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state(), RTOL, ATOL, f"step {step}")


@distributed(world_size=2)
@pytest.mark.parametrize(("norm_type", "split_only_weights"), [(2.0, False), (math.inf, False), (2.0, True)])
def test_zero_gemini_optimizer_clipping_over_tp_group(
    rank: int, world_size: int, norm_type: float, split_only_weights: bool
) -> None:
    """Each rank holds a different 'tensor-parallel' half (zero group of one, tp_group = both ranks): the clipping
    norm must cover both halves, as torch's clip_grad_norm_ over the union of their parameters. With
    `tp_split_params` naming only the weights, every other parameter counts as a TP replica: once, from TP rank 0."""
    single_groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    sgd = OPTIMIZERS["sgd"]
    references = [Reference(make_gpt(seed=r), 1, sgd) for r in range(world_size)]
    ddp = GeminiDDP(
        make_gpt(seed=rank),
        chunk_config_dict={"chunk_size": 2048},
        mixed_precision=torch.float32,
        zero_group=single_groups[rank],
    )
    names = [name for name, _ in make_gpt(seed=rank).named_parameters()]
    split = [name for name in names if name.endswith("weight")] if split_only_weights else None
    optimizer = GeminiOptimizer(
        sgd(list(ddp.parameters())),
        ddp,
        max_norm=0.05,
        norm_type=norm_type,
        tp_group=dist.group.WORLD,
        tp_split_params=split,
    )
    for step in range(2):
        x, y = batch(step, 1)
        optimizer.zero_grad()
        optimizer.backward(lm_loss(ddp(x), y))
        optimizer.step()
        grads = [ref.grads(step) for ref in references]
        counted = [
            g
            for r, gs in enumerate(grads)
            for name, g in zip(names, gs, strict=True)
            if g is not None and (split is None or r == 0 or name in split)
        ]
        flat = counted
        total = float(torch.nn.utils.get_total_norm(flat, norm_type))
        coefficient = min(1.0, 0.05 / (total + 1e-6))
        for ref, gs in zip(references, grads, strict=True):
            ref.apply([None if g is None else g * coefficient for g in gs])
        norm = optimizer.get_grad_norm()
        assert norm is not None
        assert math.isclose(norm, total, rel_tol=1e-5)
        assert_state_close(ddp.state_dict(only_rank_0=False), references[rank].state(), RTOL, ATOL, f"step {step}")
