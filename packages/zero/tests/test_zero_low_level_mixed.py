"""LowLevelZeroOptimizer with bf16/fp16 working parameters and fp32 master weights, and fp16 overflow handling."""

from __future__ import annotations

import pytest
import torch

from cx_mesh.testing import distributed
from cx_zero import DynamicGradScaler, LowLevelZeroOptimizer
from zero_test_helpers import Reference, assert_params_close, batch, clone_model, local, loss_of, make_model

STEPS = 3
LR = 1e-2


def _step(rank: int, world_size: int, optimizer: LowLevelZeroOptimizer, model: torch.nn.Module, step: int) -> None:
    x, y = batch("mlp", step, world_size)
    optimizer.zero_grad()
    optimizer.backward(loss_of("mlp", model, local(x, rank, world_size).to(torch.float32), local(y, rank, world_size)))
    optimizer.step()


def _input_cast(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    model.register_forward_pre_hook(lambda _m, args: tuple(a.to(dtype) for a in args))
    return model


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("cpu_offload", [False, True])
def test_zero_low_precision_fp32_communication_matches_reference(
    rank: int, world_size: int, dtype: torch.dtype, stage: int, cpu_offload: bool
) -> None:
    """Gradients summed in fp32: each replica's low-precision gradient is identical on both sides, so the fp32
    masters agree to fp32 rounding and the working parameters are those masters rounded to `dtype`."""
    model = _input_cast(make_model("mlp").to(dtype), dtype)
    scale = 2.0**10
    reference = Reference(_input_cast(clone_model(model), dtype), lr=LR, scale=scale if dtype == torch.float16 else 1)
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01),
        partition_grad=stage == 2,
        communication_dtype=torch.float32,
        initial_scale=scale,
        cpu_offload=cpu_offload,
    )
    for step in range(STEPS):
        _step(rank, world_size, optimizer, model, step)
        assert not optimizer.last_step_skipped
        reference.train_step("mlp", step, world_size)
        masters = optimizer.get_working_to_master_map()
        assert all(p.dtype == dtype for p in model.parameters())
        for (name, p), ref_master in zip(model.named_parameters(), reference.masters, strict=True):
            mine = masters[id(p)]
            padded = torch.nn.functional.pad(ref_master.detach().reshape(-1), (0, (-p.numel()) % world_size))
            expected = padded.view(world_size, -1)[rank]
            torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6, msg=f"master of {name}, step {step}")
        # Working = master rounded to dtype: equal up to one rounding step where the masters differ by an ulp.
        assert_params_close(model, reference.model, rtol=2**-7, atol=1e-6, what=f"working step {step}")


@distributed(world_size=2)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_zero_low_precision_communication_within_tolerance(rank: int, world_size: int, dtype: torch.dtype) -> None:
    """Gradients summed in `dtype` (the default): the averaged gradient carries one extra rounding (relative
    2**-8 for bf16, 2**-11 for fp16). Adam's update m/sqrt(v) is scale-free, so each step's update differs by about
    lr times that relative error; over 3 steps the masters stay within 3 * lr * 2**-6 (a 4x margin)."""
    model = _input_cast(make_model("mlp").to(dtype), dtype)
    scale = 2.0**10
    reference = Reference(_input_cast(clone_model(model), dtype), lr=LR, scale=scale if dtype == torch.float16 else 1)
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), partition_grad=True, initial_scale=scale
    )
    for step in range(STEPS):
        _step(rank, world_size, optimizer, model, step)
        reference.train_step("mlp", step, world_size)
    masters = optimizer.get_working_to_master_map()
    for p, ref_master in zip(model.parameters(), reference.masters, strict=True):
        padded = torch.nn.functional.pad(ref_master.detach().reshape(-1), (0, (-p.numel()) % world_size))
        torch.testing.assert_close(masters[id(p)], padded.view(world_size, -1)[rank], rtol=0, atol=STEPS * LR * 2**-6)


@distributed(world_size=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_bf16_without_master_weights(rank: int, world_size: int, stage: int) -> None:
    """master_weights=False: the optimizer steps bf16 shards (as torch AdamW on a bf16 model does)."""
    dtype = torch.bfloat16
    model = _input_cast(make_model("mlp").to(dtype), dtype)
    reference_model = _input_cast(clone_model(model), dtype)
    reference_optim = torch.optim.AdamW(reference_model.parameters(), lr=LR, weight_decay=0.01)
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01),
        partition_grad=stage == 2,
        master_weights=False,
        communication_dtype=torch.float32,
    )
    assert all(m.dtype == dtype for m in optimizer.get_working_to_master_map().values())
    for step in range(STEPS):
        _step(rank, world_size, optimizer, model, step)
        x, y = batch("mlp", step, world_size)
        grads = []
        for r in range(world_size):
            reference_model.zero_grad()
            loss_of("mlp", reference_model, local(x, r, world_size), local(y, r, world_size)).backward()
            grads.append([p.grad.float() for p in reference_model.parameters() if p.grad is not None])
        for i, p in enumerate(reference_model.parameters()):
            p.grad = (sum(g[i] / world_size for g in grads)).to(dtype)  # type: ignore[union-attr]
        reference_optim.step()
        # Identical bf16 arithmetic on both sides; an ulp apart at most where the fp32 average rounds differently.
        assert_params_close(model, reference_model, rtol=2**-7, atol=1e-5, what=f"step {step}")


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_fp16_overflow_skips_step_on_every_rank(rank: int, world_size: int, stage: int) -> None:
    """An inf gradient on one rank only: every rank skips, parameters and optimizer state are untouched, and the
    scale backs off after `hysteresis` overflows exactly as a lone DynamicGradScaler does."""
    dtype = torch.float16
    model = _input_cast(make_model("mlp").to(dtype), dtype)
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR),
        partition_grad=stage == 2,
        initial_scale=2**8,
        hysteresis=2,
        verbose=True,  # logs each skipped step on rank 0
    )
    expected = DynamicGradScaler(initial_scale=2**8, hysteresis=2, growth_interval=2000, min_scale=1, max_scale=2**24)
    _step(rank, world_size, optimizer, model, 0)
    expected.update(False)
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: {n: t.clone() for n, t in v.items()} for k, v in optimizer.state_dict()["state"].items()}
    for step in (1, 2):
        x, y = batch("mlp", step, world_size)
        optimizer.zero_grad()
        loss = loss_of("mlp", model, local(x, rank, world_size), local(y, rank, world_size))
        if rank == world_size - 1:
            loss = loss * float("inf")
        optimizer.backward(loss)
        optimizer.step()
        expected.update(True)
        assert optimizer.last_step_skipped
        assert optimizer.loss_scale == expected.scale
        for p, q in zip(model.parameters(), before, strict=True):
            assert torch.equal(p, q)
        state_after = optimizer.state_dict()["state"]
        for key, entries in state_before.items():
            for name, tensor in entries.items():
                assert torch.equal(state_after[key][name], tensor)
    assert optimizer.loss_scale == 2**7
    _step(rank, world_size, optimizer, model, 3)
    assert not optimizer.last_step_skipped
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@distributed(world_size=2)
def test_zero_fp16_backward_by_grad_takes_the_already_scaled_gradient(rank: int, world_size: int) -> None:
    """A pipeline stage receives the gradient of the next stage's scaled loss: backward_by_grad must use it as
    given (ColossalAI's contract), so it trains exactly like backward(loss) on the whole model (SGD: a doubly
    scaled gradient would overflow or move the weights 2**10 times too far)."""
    scale = 2.0**10
    models = [_input_cast(make_model("mlp").to(torch.float16), torch.float16) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [
        LowLevelZeroOptimizer(torch.optim.SGD(m.parameters(), lr=LR), initial_scale=scale, partition_grad=True)
        for m in models
    ]
    for step in range(STEPS):
        x, y = batch("mlp", step, world_size)
        mine_x, mine_y = local(x, rank, world_size).to(torch.float32), local(y, rank, world_size)
        _step(rank, world_size, optimizers[0], models[0], step)
        optimizers[1].zero_grad()
        out = models[1](mine_x)
        detached = out.detach().float().requires_grad_(True)
        downstream = ((detached - mine_y) ** 2).mean() * scale  # what the last stage's backward(loss) differentiates
        (upstream,) = torch.autograd.grad(downstream, detached)
        optimizers[1].backward_by_grad(out, upstream.to(out.dtype))
        optimizers[1].step()
        assert not optimizers[1].last_step_skipped
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
