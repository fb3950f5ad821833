"""Several process groups in one optimizer: dense parameters over 4 ranks, experts over 2-rank `moe_dp` groups with
experts that some (or all) ranks of a group never route to; and a second data-parallel dimension (extra_dp_group)."""

from __future__ import annotations

from typing import cast

import pytest
import torch

from cx_mesh.testing import distributed
from cx_zero import LowLevelZeroOptimizer
from zero_test_helpers import (
    Experts,
    Reference,
    assert_params_close,
    batch,
    clone_model,
    local,
    loss_of,
    make_mlp,
    make_model,
    mesh_2x2,
    subgroup,
    world_group,
)

# Ranks (a, b) = divmod(rank, 2). Expert set b lives on ranks {b, 2 + b} (the moe_dp group along axis "a").
# Set 0: expert 2 is routed by neither of its ranks (skipped like a torch parameter without grad); expert 1 only by
# rank 0. Set 1: expert 0 only by rank 3, expert 1 only by rank 1.
ROUTES = {0: [0, 1, 0], 1: [1, 1, 2], 2: [0, 0, 0], 3: [0, 2, 2]}
STEPS = 3
RTOL, ATOL = 1e-5, 1e-6


def _models() -> tuple[Experts, Experts]:
    torch.manual_seed(0)
    first = Experts()
    torch.manual_seed(1)
    second = Experts()
    second.dense = first.dense  # the dense layer is one parameter set shared by all ranks
    return first, second


def _loss(model: Experts, rank: int, step: int) -> torch.Tensor:
    x, y = batch("mlp", step, 4)
    out: torch.Tensor = model(local(x, rank, 4), ROUTES[rank])
    return ((out - local(y, rank, 4)) ** 2).mean()


def _grads(loss: torch.Tensor, model: Experts) -> tuple[torch.Tensor | None, ...]:
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return cast(tuple[torch.Tensor | None, ...], grads)


def _reference_step(sets: tuple[Experts, Experts], optim: torch.optim.Optimizer, step: int) -> None:
    """Dense gradients averaged over all 4 ranks, each expert set's over its own 2 ranks (as moe_dp groups do)."""
    optim.zero_grad(set_to_none=True)
    for rank in range(4):
        model = sets[rank % 2]
        grads = _grads(_loss(model, rank, step), model)
        for p, g in zip(model.parameters(), grads, strict=True):
            if g is None:
                continue
            weight = 0.25 if any(p is q for q in model.dense.parameters()) else 0.5
            p.grad = g * weight if p.grad is None else p.grad + g * weight
    optim.step()


@distributed(world_size=4)
@pytest.mark.parametrize(
    ("stage", "overlap", "experts_first"), [(1, False, False), (2, False, False), (2, True, False), (2, True, True)]
)
def test_zero_dense_and_expert_groups_match_reference(
    rank: int, world_size: int, stage: int, overlap: bool, experts_first: bool
) -> None:
    mesh = mesh_2x2()
    moe_dp = mesh.get_group_along_axis("a")
    reference_sets = _models()
    unique = list({id(p): p for m in reference_sets for p in m.parameters()}.values())
    reference_optim = torch.optim.AdamW(unique, lr=1e-2, weight_decay=0.01)
    model = clone_model(reference_sets[rank % 2])
    groups = [(world_group(), list(model.dense.parameters())), (moe_dp, model.expert_params())]
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
        pg_to_param_list=dict(reversed(groups) if experts_first else groups),
        partition_grad=stage == 2,
        overlap_communication=overlap,
        overlap_allgather=overlap,
        reduce_bucket_size=20,
        module=model,
    )
    never_routed = [p.detach().clone() for p in model.experts[2].parameters()]
    for step in range(STEPS):
        optimizer.zero_grad()
        optimizer.backward(_loss(model, rank, step))
        optimizer.step()
        optimizer.synchronize_working_params()
        _reference_step(reference_sets, reference_optim, step)
        assert_params_close(model, reference_sets[rank % 2], RTOL, ATOL, f"step {step}")
    state = optimizer.state_dict()["state"]
    if rank % 2 == 0:
        assert all(torch.equal(p, q) for p, q in zip(model.experts[2].parameters(), never_routed, strict=True))
        assert "experts.2.weight" not in state
    assert "experts.1.weight" in state
    assert "dense.weight" in state
    # The norm covers the dense layer once and every expert set once: reduced over the dense group, not moe_dp.
    assert optimizer.get_grad_norm() is not None


@distributed(world_size=4)
def test_zero_expert_groups_stage1_stage2_bit_identical(rank: int, world_size: int) -> None:
    moe_dp = mesh_2x2().get_group_along_axis("a")
    results = []
    for stage2 in (False, True):
        model = clone_model(_models()[rank % 2])
        optimizer = LowLevelZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            pg_to_param_list={world_group(): list(model.dense.parameters()), moe_dp: model.expert_params()},
            partition_grad=stage2,
            overlap_communication=stage2,
            reduce_bucket_size=7,
        )
        for step in range(STEPS):
            optimizer.zero_grad()
            optimizer.backward(_loss(model, rank, step))
            optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*results, strict=True))


@distributed(world_size=4)
def test_zero_grad_norm_and_clipping_span_dense_and_expert_groups(rank: int, world_size: int) -> None:
    moe_dp = mesh_2x2().get_group_along_axis("a")
    reference_sets = _models()
    model = clone_model(reference_sets[rank % 2])
    optimizer = LowLevelZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        pg_to_param_list={world_group(): list(model.dense.parameters()), moe_dp: model.expert_params()},
        clip_grad_norm=0.01,
    )
    unique = list({id(p): p for m in reference_sets for p in m.parameters()}.values())
    reference_optim = torch.optim.SGD(unique, lr=0.1)
    optimizer.backward(_loss(model, rank, 0))
    optimizer.step()
    reference_optim.zero_grad(set_to_none=True)
    # Re-run the reference step by hand to read its norm before clipping.
    for r in range(4):
        m = reference_sets[r % 2]
        grads = _grads(_loss(m, r, 0), m)
        for p, g in zip(m.parameters(), grads, strict=True):
            if g is not None:
                weight = 0.25 if any(p is q for q in m.dense.parameters()) else 0.5
                p.grad = g * weight if p.grad is None else p.grad + g * weight
    norm = torch.nn.utils.clip_grad_norm_(unique, 0.01)
    reference_optim.step()
    assert optimizer.get_grad_norm() == pytest.approx(float(norm), rel=1e-5)
    assert float(norm) > 0.01
    assert_params_close(model, reference_sets[rank % 2], RTOL, ATOL)


@distributed(world_size=4)
@pytest.mark.parametrize(("stage", "overlap"), [(1, False), (2, False), (2, True)])
def test_zero_extra_dp_group_matches_reference(rank: int, world_size: int, stage: int, overlap: bool) -> None:
    """Partitioned over 2 ranks (axis "b"), replicated over the other 2 (axis "a"): gradients average over all 4."""
    mesh = mesh_2x2()
    model = make_model("mlp")
    reference = Reference(clone_model(model))
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
        partition_grad=stage == 2,
        dp_process_group=mesh.get_group_along_axis("b"),
        extra_dp_group=mesh.get_group_along_axis("a"),
        overlap_communication=overlap,
        overlap_allgather=overlap,
        reduce_bucket_size=50,
    )
    for step in range(STEPS):
        x, y = batch("mlp", step, 4)
        optimizer.zero_grad()
        optimizer.backward(loss_of("mlp", model, local(x, rank, 4), local(y, rank, 4)))
        optimizer.step()
        optimizer.synchronize_working_params()
        reference.train_step("mlp", step, 4)
        assert_params_close(model, reference.model, RTOL, ATOL, f"step {step}")
        assert optimizer.get_grad_norm() == pytest.approx(reference.last_norm, rel=1e-5)


@distributed(world_size=4)
def test_zero_non_nested_groups_rejected(rank: int, world_size: int) -> None:
    mesh = mesh_2x2()
    model = make_mlp()
    with pytest.raises(ValueError, match="must be nested"):
        LowLevelZeroOptimizer(
            torch.optim.AdamW(model.parameters()),
            pg_to_param_list={
                mesh.get_group_along_axis("a"): list(model.fc1.parameters()),
                mesh.get_group_along_axis("b"): [*model.fc2.parameters(), *model.fc3.parameters()],
            },
        )


@distributed(world_size=4)
def test_zero_norm_includes_tp_group(rank: int, world_size: int) -> None:
    """DP over axis "a", a toy TP split over axis "b" (each TP rank holds a different model part): the clipping
    norm is the norm over both parts, as `clip_grad_norm_` over the unsplit model gives."""
    mesh = mesh_2x2()
    dp_rank, tp_rank = divmod(rank, 2)
    parts = [make_mlp(seed=10 + b) for b in range(2)]
    model = clone_model(parts[tp_rank])
    optimizer = LowLevelZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        dp_process_group=mesh.get_group_along_axis("a"),
        tp_process_group=mesh.get_group_along_axis("b"),
        clip_grad_norm=0.01,
    )
    x, y = batch("mlp", 0, 2)
    optimizer.backward(loss_of("mlp", model, local(x, dp_rank, 2), local(y, dp_rank, 2)))
    optimizer.step()
    everything = [p for part in parts for p in part.parameters()]
    for part in parts:
        for r in range(2):
            (loss_of("mlp", part, local(x, r, 2), local(y, r, 2)) / 2).backward()
    norm = torch.nn.utils.clip_grad_norm_(everything, 0.01)
    torch.optim.SGD(everything, lr=0.1).step()
    assert float(norm) > 0.01
    assert optimizer.get_grad_norm() == pytest.approx(float(norm), rel=1e-5)
    assert_params_close(model, parts[tp_rank], RTOL, ATOL)


@distributed(world_size=4)
def test_zero_expert_overflow_skips_the_step_on_every_rank(rank: int, world_size: int) -> None:
    """fp16: an inf only in expert set 1's gradient on rank 3 (moe_dp group {1, 3}): ranks 0 and 2, whose own
    gradients are finite, skip too, because the flag is reduced over the dense group that spans both expert groups."""
    moe_dp = mesh_2x2().get_group_along_axis("a")
    model = clone_model(_models()[rank % 2]).half()
    model.register_forward_pre_hook(lambda _m, args: (args[0].half(), args[1]))
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        pg_to_param_list={world_group(): list(model.dense.parameters()), moe_dp: model.expert_params()},
        partition_grad=True,
        initial_scale=2**8,
        hysteresis=1,
    )
    before = [p.detach().clone() for p in model.parameters()]
    if rank == 3:
        expert = model.experts[0]
        assert isinstance(expert, torch.nn.Linear)
        expert.weight.register_hook(lambda g: g * float("inf"))
    optimizer.backward(_loss(model, rank, 0).float())
    optimizer.step()
    assert optimizer.last_step_skipped
    assert optimizer.loss_scale == 2**7
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert not optimizer.optim.state


@distributed(world_size=4, timeout=60)
def test_zero_independent_groups_never_communicate_across(rank: int, world_size: int) -> None:
    """Ranks {0,1} and {2,3} train separate fp16 models over their own DP groups, a different number of steps, with
    an overflow on rank 0: a reduction over the world (ColossalAI #5003) would hang here."""
    pairs = (subgroup((0, 1)), subgroup((2, 3)))
    model = make_mlp(seed=rank // 2).half()
    model.register_forward_pre_hook(lambda _m, args: (args[0].half(),))
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), dp_process_group=pairs[rank // 2], initial_scale=2**8
    )
    skipped = []
    for step in range(2 if rank < 2 else 3):
        x, y = batch("mlp", step, 2)
        loss = loss_of("mlp", model, local(x, rank % 2, 2), local(y, rank % 2, 2))
        if rank == 0 and step == 0:
            loss = loss * float("inf")
        optimizer.zero_grad()
        optimizer.backward(loss)
        optimizer.step()
        skipped.append(optimizer.last_step_skipped)
    assert skipped == ([True, False] if rank < 2 else [False, False, False])
