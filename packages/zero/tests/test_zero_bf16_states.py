"""Adam's moments in bf16 with stochastic rounding (`optimizer_states_dtype=bf16`): the rounding is unbiased and
reproducible, the fp32 step math is torch's, the moments take half the bytes, and checkpoints round-trip (bf16 into
bf16 bit for bit, so a resume continues exactly; bf16 into fp32 states by an exact cast)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from cx_mesh.testing import distributed
from cx_zero import Bf16StateAdam, CPUAdam, LowLevelZeroOptimizer, LowLevelZeroOptions, stochastic_round_bf16
from zero_test_helpers import batch, local, loss_of, make_mlp

N = 100_000


def test_stochastic_rounding_is_unbiased_and_reproducible() -> None:
    low, ulp = 1.0, 2.0**-7  # bf16 neighbours of 1 + 3/8 ulp
    value = torch.full((N,), low + 0.375 * ulp)
    for sign in (1.0, -1.0):
        rounded = stochastic_round_bf16(sign * value, torch.Generator().manual_seed(0)).float()
        assert set(rounded.abs().unique().tolist()) == {low, low + ulp}, "only the two neighbours"
        up = float((rounded.abs() > low).float().mean())
        assert abs(up - 0.375) < 5 * math.sqrt(0.375 * 0.625 / N), f"rounded up {up} of the time, expected 3/8"
    first = stochastic_round_bf16(value, torch.Generator().manual_seed(7))
    assert torch.equal(first, stochastic_round_bf16(value, torch.Generator().manual_seed(7)))
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
    assert torch.equal(stochastic_round_bf16(special, torch.Generator()), special.bfloat16())
    assert stochastic_round_bf16(torch.tensor([float("nan")]), torch.Generator()).isnan().all()


@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
def test_first_step_is_torchs_and_moments_within_one_bf16_ulp(kind: type[torch.optim.Adam]) -> None:
    """The first update uses the fp32 moments before they are stored, so it is torch's up to the order of fp32
    operations; the stored moments are torch's rounded up or down to a neighbouring bf16 value (< 1 ulp = 2^-7
    relative)."""
    torch.manual_seed(0)
    start = torch.randn(257)
    grad = torch.randn(257)
    mine, theirs = start.clone(), start.clone()
    ours = kind([mine], lr=1e-2, weight_decay=0.1)
    reference = kind([theirs], lr=1e-2, weight_decay=0.1)
    mine.grad, theirs.grad = grad.clone(), grad.clone()
    Bf16StateAdam(ours, seed=0).step()
    reference.step()
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    for key in ("exp_avg", "exp_avg_sq"):
        stored, exact = ours.state[mine][key], reference.state[theirs][key]
        assert stored.dtype == torch.bfloat16
        assert ((stored.float() - exact).abs() <= exact.abs() * 2.0**-7).all(), key


@pytest.mark.parametrize("kind", [torch.optim.AdamW, CPUAdam])
def test_bf16_step_is_the_optimizers_own_step_call(kind: type[torch.optim.AdamW] | type[CPUAdam]) -> None:
    """The update enters through the optimizer's `step`, so an LR scheduler sees it stepped (no "lr_scheduler.step()
    before optimizer.step()" warning) and step hooks run once around it; the optimizer's own update adds nothing
    (the moments stay bf16, the step counter at 1)."""
    param = torch.nn.Parameter(torch.randn(33))
    optimizer = kind([param], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    seen: list[str] = []
    optimizer.register_step_pre_hook(lambda *_: seen.append("pre"))
    optimizer.register_step_post_hook(lambda *_: seen.append("post"))
    states = Bf16StateAdam(optimizer, seed=0)
    param.grad = torch.randn(33)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        states.step()
        scheduler.step()
    assert seen == ["pre", "post"]
    assert all(p.grad is None for p in optimizer.param_groups[0]["params"]), "the stepped gradients are taken away"
    state = optimizer.state[param]
    assert float(state["step"]) == 1.0
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert optimizer.param_groups[0]["lr"] == 0.5e-2


def test_bf16_states_refuse_other_optimizers() -> None:
    with pytest.raises(TypeError, match="Adam"):
        Bf16StateAdam(torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1), seed=0)
    with pytest.raises(ValueError, match="amsgrad"):
        Bf16StateAdam(torch.optim.Adam([torch.zeros(2, requires_grad=True)], amsgrad=True), seed=0)
    with pytest.raises(ValueError, match="optimizer_states_dtype"):
        LowLevelZeroOptions(optimizer_states_dtype=torch.float16)


def _zero(dtype: torch.dtype, seed: int = 0) -> tuple[torch.nn.Module, LowLevelZeroOptimizer]:
    model = make_mlp(seed)
    options = LowLevelZeroOptions(optimizer_states_dtype=dtype)
    return model, LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), module=model, options=options)


def _train(rank: int, world_size: int, model: torch.nn.Module, optimizer: LowLevelZeroOptimizer, steps: range) -> None:
    for step in steps:
        x, y = batch("mlp", step, world_size)
        optimizer.zero_grad()
        optimizer.backward(loss_of("mlp", model, local(x, rank, world_size), local(y, rank, world_size)))
        optimizer.step()


@distributed(world_size=2)
def test_zero_bf16_states_halve_the_moments_and_resume_exactly(rank: int, world_size: int) -> None:
    sizes = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, optimizer = _zero(dtype)
        _train(rank, world_size, model, optimizer, range(2))
        shard_numel = sum(m.numel() for m in optimizer.get_working_to_master_map().values())
        states = list(optimizer.optim.state.values())
        assert all(s[k].dtype == dtype for s in states for k in ("exp_avg", "exp_avg_sq"))
        # per parameter: two moments of shard_numel elements and a 0-d fp32 step
        expected = 2 * shard_numel * dtype.itemsize + 4 * len(states)
        sizes[dtype] = optimizer.local_state_bytes()["optimizer_state"]
        assert sizes[dtype] == expected, (dtype, sizes[dtype], expected)
    moments = {d: sizes[d] - 4 * len(states) for d in sizes}
    assert moments[torch.bfloat16] * 2 == moments[torch.float32], "bf16 moments take half the bytes"

    model, optimizer = _zero(torch.bfloat16)
    _train(rank, world_size, model, optimizer, range(3))
    saved = optimizer.state_dict()
    assert saved["state"]["fc1.weight"]["exp_avg"].dtype == torch.bfloat16

    resumed_model, resumed = _zero(torch.bfloat16, seed=1)
    resumed_model.load_state_dict(model.state_dict())
    resumed.update_master_params(resumed_model)
    resumed.load_state_dict(saved)
    _train(rank, world_size, model, optimizer, range(3, 6))
    _train(rank, world_size, resumed_model, resumed, range(3, 6))
    for (name, want), got in zip(model.named_parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(got, want), f"{name} differs after resuming bf16 states"

    _, as_fp32 = _zero(torch.float32, seed=1)
    as_fp32.load_state_dict(saved)  # bf16 moments into fp32 states: an exact cast
    loaded = as_fp32.state_dict()
    for name, entry in saved["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["state"][name][key], entry[key].float()), (name, key)
